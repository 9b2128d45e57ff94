"""benchmarks/tune_lora_tiles.py on the CPU (Triton's interpreter, the tiny shape, a few candidates):
it writes a file the engine's parser takes, with the tiles it printed, one expand entry for the two
targets whose expands are alike, and a later run keeps the entries it does not replace."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
import json

import pytest

pytest.importorskip("triton")

from benchmarks.tune_lora_tiles import (
    decode_expand_tiles,
    decode_grouping,
    decode_shrink_tiles,
    graph_meta,
    main,
    prefill_grouping,
    resolve_device,
    sgmv_tiles,
    write,
)
from lorakernels import tuned

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU smoke run; the GPU tunes for real")


def test_tuner_writes_a_file_the_kernels_use(tmp_path, capsys):
    args = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--quick", "--reps", "1", "--max-rank", "16"]
    args += ["--tokens", "2", "--adapters", "2", "--prefill-tokens", "40", "--prefill-segments", "2"]
    path, entries = main([*args, "--targets", "o", "down", "--out", str(tmp_path)])
    assert path == tmp_path / "cpu.json"
    # in fp32 every candidate computes the built-in tile's result: none is left out
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("#") and "wrote" not in line]
    doc = json.loads(path.read_text())
    assert doc["device"] == "cpu" and doc["made_by"] == "benchmarks/tune_lora_tiles.py"
    # o (in 64) and down (in 176) shrink apart; both expand 64 wide from one stacked target: one entry
    assert [(e["kernel"], e["target"], e["tokens"]) for e in doc["entries"]] == [
        ("shrink", "o", 2), ("expand", "o", 2), ("sgmv_shrink", "o", 40), ("sgmv_expand", "o", 40),
        ("shrink", "down", 2), ("sgmv_shrink", "down", 40),
    ]  # fmt: skip
    assert doc["entries"] == entries
    tiles = tuned.parse(doc, str(path))
    for entry in entries:
        assert set(entry["builtin_us"]) == set(entry["chosen_us"]) == {"2"}  # one grouping: 2 adapters or segments
        dim = entry.get("in_dim", entry.get("out_dim"))
        assert dataclasses.asdict(tiles.lookup(entry["kernel"], dim, 1, 16, entry["tokens"])) == entry["config"]


def test_a_later_run_replaces_its_own_entries_and_keeps_the_rest(tmp_path):
    path = tmp_path / "cpu.json"

    def entry(tokens, block_n):
        return {
            "kernel": "expand",
            "out_dim": 64,
            "num_stack": 1,
            "max_rank": 16,
            "tokens": tokens,
            "config": {"block_n": block_n, "num_warps": 4},
        }

    write(path, "cpu", [entry(1, 32), entry(8, 32)])
    write(path, "cpu", [entry(8, 64), entry(16, 128)])
    tiles = tuned.load_file(path)
    assert [tiles.lookup("expand", 64, 1, 16, t).block_n for t in (1, 8, 16)] == [32, 64, 128]
    with pytest.raises(ValueError, match="block_n"):
        write(path, "cpu", [entry(4, 100)])
    assert len(tuned.load_file(path)) == 3 and [p.name for p in tmp_path.iterdir()] == [
        "cpu.json"
    ]  # left as it was


def test_the_tuned_steps_have_the_engines_layouts():
    """Decode rows merge per adapter into runs of at most DECODE_RUN (16) rows and pad to the batch, as a
    decode graph holds them; prefill groupings are prompts or a mixed step, and a step graph's metadata
    has every segment slot and its token count as max_seg_len."""
    assert decode_grouping(32, 1) == ([16, 16] + [0] * 30, [1, 1] + [0] * 30)
    assert decode_grouping(8, 3) == ([3, 3, 2, 0, 0, 0, 0, 0], [1, 2, 3, 0, 0, 0, 0, 0])
    assert prefill_grouping(102, "4") == ([26, 26, 25, 25], [1, 2, 3, 4])
    lens, slots = prefill_grouping(200, "mixed")
    assert lens == [137] + [1] * 63 and slots[:10] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 2] and max(slots) == 9
    meta = graph_meta([26, 26, 25, 25], [1, 2, 3, 4], [0, 16, 16, 16, 16], [0.0] + [2.0] * 4, 64, "cpu")
    assert (meta.num_segments, meta.max_seg_len, meta.host_seg_lens) == (64, 102, None)
    assert meta.seg_indptr.tolist()[:6] == [0, 26, 52, 77, 102, 102] and meta.seg_indptr[-1] == 102


def test_a_bare_cuda_device_gets_an_index():
    """The default --device cuda once failed at torch.cuda.set_device, which wants an index."""
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
@pytest.mark.parametrize("num_sms", [8, 132])
def test_every_candidate_is_a_tile_the_parser_takes(monkeypatch, quick, num_sms):
    """What the tuner may write, the engine's parser reads: candidates for an H200's 132 SMs and for 8."""
    import benchmarks.tune_lora_tiles as tuner
    import lorakernels.sgmv_decode as sgmv_decode

    for module in (tuner, sgmv_decode):
        monkeypatch.setattr(module, "_num_sms", lambda _device: num_sms)
    shrinks = [t for stack in (1, 2, 3) for t in decode_shrink_tiles(stack, torch.device("cpu"), quick)]
    assert shrinks[0].num_programs == 2 * num_sms  # the built-in tile first: two programs an SM
    candidates = {"shrink": shrinks, "expand": decode_expand_tiles(quick)}
    candidates |= {"sgmv_shrink": sgmv_tiles(True, 64, quick), "sgmv_expand": sgmv_tiles(False, 16, quick)}
    # prefill shrinks split over in_dim are candidates; expands never split
    assert any(t.split_k > 1 for t in candidates["sgmv_shrink"]) and all(t.split_k == 1 for t in candidates["sgmv_expand"])
    for kernel, tiles in candidates.items():
        shape = dict.fromkeys(tuned.KINDS[kernel][0], 64)
        entries = [{"kernel": kernel, **shape, "tokens": i + 1, "config": dataclasses.asdict(t)} for i, t in enumerate(tiles)]
        assert len(tuned.parse({"entries": entries}, "t")) == len(tiles) > 1
