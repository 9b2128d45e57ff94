"""benchmarks/slot_load.py on the CPU with the tiny shape (a smoke test: host times only)."""

from benchmarks.engine_step import SHAPES
from benchmarks.slot_load import main


def test_loads_alone_and_beside_decode_steps():
    rows = main(["--batch", "4", "--adapters", "2", "--num-steps", "2", "--repeats", "1", "--slot-max-rank", "16"])
    loads = {row["adapter"]: row for row in rows if row["part"] == "load"}
    c = SHAPES["tiny"]
    # a q/v adapter packs only q/k/v: A [layers, 3 * rank, hidden] and B [layers, q + 2 kv, rank], fp32 here
    qkv_out = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    assert loads["qv"]["bytes"] == c.num_layers * 16 * (3 * c.hidden_size + qkv_out) * 4
    assert loads["all"]["bytes"] > loads["qv"]["bytes"]
    decode = [row for row in rows if row["part"] == "decode"]
    assert [row["adapter"] for row in decode] == ["all", "qv"]
    assert all(row["decode_step_ms"] > 0 and row["with_load_step_ms"] > 0 for row in decode)
