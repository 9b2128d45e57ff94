"""What both services and their clients share about who is calling: roles, principals, API keys, the
`authorization: Bearer KEY` metadata, and TLS credentials. Pure policy and formats; the registry owns
the keys' storage (registry/access.py), the engine checks keys through the registry (engine/auth.py).

Keys look like `lmx_<key id>_<secret>`: the key id (12 hex digits) is public and names the key in
lists and audit rows; only sha256(secret) is stored. Secrets have 256 bits of entropy, so a plain
hash is enough (no password stretching) and a lookup by key id costs one indexed read.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from loraformat.errors import Code, StatusError

KEY_PREFIX = "lmx"
_KEY_RE = re.compile(r"^lmx_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")
MAX_TENANT_LEN = 64
TENANT_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


class Role(enum.Enum):
    ADMIN = "admin"  # everything: every tenant's adapters, base models, keys, audit
    PUBLISHER = "publisher"  # register, delete and pin its own tenant's adapters; generate like a user
    USER = "user"  # generate with the base model, its tenant's adapters and public ones
    ENGINE = "engine"  # an engine's own key: read every adapter, register its base model, check keys


class Unauthenticated(StatusError):
    code = Code.UNAUTHENTICATED


class PermissionDenied(StatusError):
    code = Code.PERMISSION_DENIED


@dataclass(frozen=True)
class Principal:
    """Who is calling. With authentication off every caller is `ANONYMOUS`, which may do everything."""

    key_id: str
    tenant: str
    role: Role

    @property
    def sees_all(self) -> bool:
        return self.role in (Role.ADMIN, Role.ENGINE)

    @property
    def is_admin(self) -> bool:
        return self.role == Role.ADMIN

    def can_see(self, tenant: str, public: bool) -> bool:
        """An adapter of `tenant`; one a caller cannot see is NOT_FOUND to it (names do not leak)."""
        return self.sees_all or public or tenant == self.tenant

    def can_change(self, tenant: str) -> bool:
        """Register, delete or pin adapters of `tenant`."""
        return self.is_admin or (self.role == Role.PUBLISHER and tenant == self.tenant)

    def require_admin(self, what: str) -> None:
        if not self.is_admin:
            raise PermissionDenied(f"{what} needs an admin key")


ANONYMOUS = Principal(key_id="", tenant="", role=Role.ADMIN)


def check_tenant(tenant: str) -> str:
    if not TENANT_RE.fullmatch(tenant):
        raise StatusError(
            f"tenant {tenant[:80]!r} is invalid: use 1-{MAX_TENANT_LEN} characters of a-z, 0-9, '.', '_', '-'"
        )
    return tenant


def parse_role(role: str) -> Role:
    try:
        return Role(role)
    except ValueError:
        names = ", ".join(r.value for r in Role)
        raise StatusError(f"role {role[:40]!r} is not one of {names}") from None


# ---- keys ---------------------------------------------------------------------------------------


def new_key() -> tuple[str, str, str]:
    """(the full key shown once, its key id, sha256 of its secret as stored)."""
    key_id, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    return f"{KEY_PREFIX}_{key_id}_{secret}", key_id, hash_secret(secret)


def split_key(key: str) -> tuple[str, str] | None:
    """(key id, sha256 of the secret), or None when `key` does not have the shape of a key."""
    found = _KEY_RE.fullmatch(key)
    return (found.group(1), hash_secret(found.group(2))) if found else None


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def same_hash(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def bearer_key(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The KEY of an `authorization: Bearer KEY` entry; '' when there is none."""
    for name, value in metadata or ():
        if name.lower() == "authorization" and isinstance(value, str):
            scheme, _, key = value.partition(" ")
            if scheme.lower() == "bearer":
                return key.strip()
    return ""


def auth_metadata(api_key: str) -> tuple[tuple[str, str], ...]:
    """What a client sends with every call; nothing when it has no key."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def write_secret_file(path: Path, text: str) -> bool:
    """Create `path` with mode 0600 holding text; False (and nothing written) when it already exists."""
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        handle.write(text + "\n")
    return True


# ---- TLS ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    """PEM files. A server with `ca` requires client certificates signed by it (mutual TLS); a client
    trusts servers signed by `ca` and presents `cert`/`key` when given."""

    cert: str = ""
    key: str = ""
    ca: str = ""

    @property
    def is_server_ready(self) -> bool:
        return bool(self.cert and self.key)

    @property
    def is_on(self) -> bool:
        return bool(self.cert or self.key or self.ca)

    def server_credentials(self) -> grpc.ServerCredentials:
        if not self.is_server_ready:
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        ca = _read(self.ca)
        pair = [(_read(self.key), _read(self.cert))]
        return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=ca is not None)

    def ssl_context(self):
        """The same files for an HTTPS server (the engine's HTTP front)."""
        import ssl

        if not self.is_server_ready:
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        if self.ca:
            context.load_verify_locations(self.ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if bool(self.cert) != bool(self.key):
            raise ValueError("a client certificate needs both --tls-cert and --tls-key")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca), private_key=_read(self.key), certificate_chain=_read(self.cert)
        )


def _read(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


def open_channel(address: str, tls: TlsFiles | None = None, options=(), aio: bool = False, api_key: str = ""):
    """A channel to a loramux service: TLS when `tls` names any file, plaintext otherwise. A synchronous
    channel sends `api_key` with every call; asynchronous callers pass `auth_metadata` per call."""
    module = grpc.aio if aio else grpc
    if tls is not None and tls.is_on:
        channel = module.secure_channel(address, tls.channel_credentials(), options=list(options))
    else:
        channel = module.insecure_channel(address, options=list(options))
    if api_key and not aio:
        channel = grpc.intercept_channel(channel, _AddMetadata(auth_metadata(api_key)))
    return channel


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


class _AddMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds fixed metadata (the authorization entry) to every call of a synchronous channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self.metadata = metadata

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        metadata = (*(d.metadata or ()), *self.metadata)
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    intercept_unary_stream = intercept_unary_unary
    intercept_stream_unary = intercept_unary_unary
    intercept_stream_stream = intercept_unary_unary


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def check_exposure(host: str, auth: bool, allow_unauthenticated: bool, service: str) -> None:
    """Without --auth, listening beyond loopback needs --allow-unauthenticated."""
    if not auth and not allow_unauthenticated and host not in LOOPBACK_HOSTS:
        raise ValueError(
            f"{service}: refusing to listen on {host} without --auth (anyone who reaches the port could"
            " do anything); add --auth, or --allow-unauthenticated if a gateway in front authenticates"
        )
