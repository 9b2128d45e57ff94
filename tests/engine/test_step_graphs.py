"""Host-side parts of the step graphs (engine/step_graphs.py): the padded token buckets and the
settings that turn them on. The graphs themselves: tests/engine/test_gpu.py (captured, on CUDA) and
tests/engine/test_engine_backends.py (the same static-buffer steps uncaptured, on the CPU)."""

import pytest

from engine.config import EngineConfig
from engine.step_graphs import TOKEN_BUCKETS, token_buckets


def test_buckets_end_at_the_token_budget_and_grow_by_512_past_the_table():
    assert token_buckets(2048) == list(TOKEN_BUCKETS)
    assert token_buckets(100) == [16, 32, 48, 64, 96, 100]
    assert token_buckets(8) == [8]
    assert token_buckets(4096)[-5:] == [2048, 2560, 3072, 3584, 4096]
    assert token_buckets(3000)[-3:] == [2048, 2560, 3000]
    assert token_buckets(7, (2, 4)) == [2, 4, 7]
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        token_buckets(0)


def test_graph_settings_refuse_negative_values():
    with pytest.raises(ValueError, match="cuda_graph_max_tokens must be >= 0"):
        EngineConfig(model_dir="m", cuda_graph_max_tokens=-1)
    with pytest.raises(ValueError, match="must be >= 0"):
        EngineConfig(model_dir="m", cuda_graph_max_batch=-1)
    assert EngineConfig(model_dir="m").cuda_graph_max_tokens == 2048
