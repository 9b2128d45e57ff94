from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BaseModel(_message.Message):
    __slots__ = ("name", "config_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    config_json: str
    def __init__(self, name: _Optional[str] = ..., config_json: _Optional[str] = ...) -> None: ...

class RegisterAdapterRequest(_message.Message):
    __slots__ = ("spec", "chunk")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    spec: AdapterSpec
    chunk: FileChunk
    def __init__(self, spec: _Optional[_Union[AdapterSpec, _Mapping]] = ..., chunk: _Optional[_Union[FileChunk, _Mapping]] = ...) -> None: ...

class AdapterSpec(_message.Message):
    __slots__ = ("name", "base_model", "pinned", "description", "labels", "source_uri", "public")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_URI_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    name: str
    base_model: str
    pinned: bool
    description: str
    labels: _containers.ScalarMap[str, str]
    source_uri: str
    public: bool
    def __init__(self, name: _Optional[str] = ..., base_model: _Optional[str] = ..., pinned: _Optional[bool] = ..., description: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., source_uri: _Optional[str] = ..., public: _Optional[bool] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("filename", "offset", "data")
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    filename: str
    offset: int
    data: bytes
    def __init__(self, filename: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class Adapter(_message.Message):
    __slots__ = ("name", "version", "digest", "base_model", "rank", "alpha", "scaling", "target_modules", "pinned", "size_bytes", "created_at", "description", "labels", "tenant", "public")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    digest: str
    base_model: str
    rank: int
    alpha: float
    scaling: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    pinned: bool
    size_bytes: int
    created_at: float
    description: str
    labels: _containers.ScalarMap[str, str]
    tenant: str
    public: bool
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., digest: _Optional[str] = ..., base_model: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., scaling: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., pinned: _Optional[bool] = ..., size_bytes: _Optional[int] = ..., created_at: _Optional[float] = ..., description: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., tenant: _Optional[str] = ..., public: _Optional[bool] = ...) -> None: ...

class GetAdapterRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("base_model", "name_prefix", "page_size", "page_token", "latest_only")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    NAME_PREFIX_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LATEST_ONLY_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    name_prefix: str
    page_size: int
    page_token: str
    latest_only: bool
    def __init__(self, base_model: _Optional[str] = ..., name_prefix: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., latest_only: _Optional[bool] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "next_page_token")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    next_page_token: str
    def __init__(self, adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteAdapterRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class DeleteAdapterResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: _containers.RepeatedCompositeFieldContainer[Adapter]
    def __init__(self, deleted: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ...) -> None: ...

class SetPinnedRequest(_message.Message):
    __slots__ = ("name", "version", "pinned")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    pinned: bool
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., pinned: _Optional[bool] = ...) -> None: ...

class FetchAdapterRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class AdapterChunk(_message.Message):
    __slots__ = ("adapter", "data")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    adapter: Adapter
    data: DataChunk
    def __init__(self, adapter: _Optional[_Union[Adapter, _Mapping]] = ..., data: _Optional[_Union[DataChunk, _Mapping]] = ...) -> None: ...

class DataChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WatchAdaptersRequest(_message.Message):
    __slots__ = ("base_model", "after_event_id")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    AFTER_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    after_event_id: int
    def __init__(self, base_model: _Optional[str] = ..., after_event_id: _Optional[int] = ...) -> None: ...

class AdapterEvent(_message.Message):
    __slots__ = ("kind", "adapter", "event_id")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[AdapterEvent.Kind]
        REGISTERED: _ClassVar[AdapterEvent.Kind]
        DELETED: _ClassVar[AdapterEvent.Kind]
        PINNED: _ClassVar[AdapterEvent.Kind]
        UNPINNED: _ClassVar[AdapterEvent.Kind]
    KIND_UNSPECIFIED: AdapterEvent.Kind
    REGISTERED: AdapterEvent.Kind
    DELETED: AdapterEvent.Kind
    PINNED: AdapterEvent.Kind
    UNPINNED: AdapterEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    kind: AdapterEvent.Kind
    adapter: Adapter
    event_id: int
    def __init__(self, kind: _Optional[_Union[AdapterEvent.Kind, str]] = ..., adapter: _Optional[_Union[Adapter, _Mapping]] = ..., event_id: _Optional[int] = ...) -> None: ...

class ListBaseModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListBaseModelsResponse(_message.Message):
    __slots__ = ("base_models",)
    BASE_MODELS_FIELD_NUMBER: _ClassVar[int]
    base_models: _containers.RepeatedCompositeFieldContainer[BaseModel]
    def __init__(self, base_models: _Optional[_Iterable[_Union[BaseModel, _Mapping]]] = ...) -> None: ...

class ApiKey(_message.Message):
    __slots__ = ("key_id", "tenant", "role", "description", "created_at", "revoked_at")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    tenant: str
    role: str
    description: str
    created_at: float
    revoked_at: float
    def __init__(self, key_id: _Optional[str] = ..., tenant: _Optional[str] = ..., role: _Optional[str] = ..., description: _Optional[str] = ..., created_at: _Optional[float] = ..., revoked_at: _Optional[float] = ...) -> None: ...

class CreateKeyRequest(_message.Message):
    __slots__ = ("tenant", "role", "description")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    role: str
    description: str
    def __init__(self, tenant: _Optional[str] = ..., role: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class CreateKeyResponse(_message.Message):
    __slots__ = ("key", "secret")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    key: ApiKey
    secret: str
    def __init__(self, key: _Optional[_Union[ApiKey, _Mapping]] = ..., secret: _Optional[str] = ...) -> None: ...

class ListKeysRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListKeysResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[ApiKey]
    def __init__(self, keys: _Optional[_Iterable[_Union[ApiKey, _Mapping]]] = ...) -> None: ...

class RevokeKeyRequest(_message.Message):
    __slots__ = ("key_id",)
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    def __init__(self, key_id: _Optional[str] = ...) -> None: ...

class CheckKeyRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class CheckKeyResponse(_message.Message):
    __slots__ = ("valid", "key")
    VALID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    valid: bool
    key: ApiKey
    def __init__(self, valid: _Optional[bool] = ..., key: _Optional[_Union[ApiKey, _Mapping]] = ...) -> None: ...

class AuditEntry(_message.Message):
    __slots__ = ("id", "at", "key_id", "tenant", "action", "target", "outcome")
    ID_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    id: int
    at: float
    key_id: str
    tenant: str
    action: str
    target: str
    outcome: str
    def __init__(self, id: _Optional[int] = ..., at: _Optional[float] = ..., key_id: _Optional[str] = ..., tenant: _Optional[str] = ..., action: _Optional[str] = ..., target: _Optional[str] = ..., outcome: _Optional[str] = ...) -> None: ...

class ListAuditRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ListAuditResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[AuditEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[AuditEntry, _Mapping]]] = ...) -> None: ...
