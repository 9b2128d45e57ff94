"""Tuned decode LoRA tiles (lorakernels/tuned.py): the file format and its refusals, the lookup by shape and
token count, and the decode kernels launching with a file's tiles and still computing the fp64 result.

Without CUDA the kernels run in Triton's CPU interpreter, whose device is named "cpu": a `cpu.json` in
the directory `use_dir` names gives the CPU tiles the way `NVIDIA_H200.json` gives an H200 its own.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json

import pytest

pytest.importorskip("triton")

from lorakernels import sgmv_decode, tuned
from lorakernels.tuned import ExpandTile, ShrinkTile
from tests.lorakernels.test_sgmv_decode import DEVICE, check_expand, check_shrink, decode_batch, merged


def shrink_entry(tokens, num_programs, block_k=128, num_warps=4, in_dim=520, num_stack=2, max_rank=64):
    config = {"num_programs": num_programs, "block_k": block_k, "num_warps": num_warps}
    return {
        "kernel": "shrink",
        "in_dim": in_dim,
        "num_stack": num_stack,
        "max_rank": max_rank,
        "tokens": tokens,
        "config": config,
    }


def expand_entry(tokens, block_n, num_warps=4, out_dim=70, num_stack=2, max_rank=64):
    config = {"block_n": block_n, "num_warps": num_warps}
    return {
        "kernel": "expand",
        "out_dim": out_dim,
        "num_stack": num_stack,
        "max_rank": max_rank,
        "tokens": tokens,
        "config": config,
    }


def sgmv_entry(kernel, dim, tokens, block_m, block_n, block_k, num_warps=4, num_stages=2, num_stack=3, **optional):
    config = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": num_warps, "num_stages": num_stages, **optional}
    key = "in_dim" if kernel == "sgmv_shrink" else "out_dim"
    return {"kernel": kernel, key: dim, "num_stack": num_stack, "max_rank": 128, "tokens": tokens, "config": config}


@pytest.fixture
def tuned_dir(tmp_path):
    """A directory the kernels look tuned files up in for the test; the package's own again after."""
    tuned.use_dir(tmp_path)
    yield tmp_path
    tuned.use_dir(None)


def write_tiles(directory, entries, device=DEVICE):
    name = tuned.device_name(torch.device(device))
    (directory / tuned.device_file_name(name)).write_text(json.dumps({"device": name, "entries": entries}))


def test_device_file_names():
    assert tuned.device_file_name("NVIDIA H200") == "NVIDIA_H200.json"
    assert tuned.device_file_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.json"
    assert tuned.device_file_name("cpu") == "cpu.json"


def test_lookup_takes_the_largest_tuned_token_count_at_or_below_the_step():
    tiles = tuned.parse(
        {"entries": [shrink_entry(64, 6), shrink_entry(8, 3), shrink_entry(16, 4), expand_entry(32, 64)]}, "t"
    )
    assert len(tiles) == 4
    steps = (1, 7, 8, 9, 16, 17, 64, 65, 512)
    pick = {t: getattr(tiles.lookup("shrink", 520, 2, 64, t), "num_programs", None) for t in steps}
    assert pick == {1: None, 7: None, 8: 3, 9: 3, 16: 4, 17: 4, 64: 6, 65: 6, 512: 6}  # none below the least
    one = tuned.parse({"entries": [expand_entry(1, 64, out_dim=1, num_stack=1, max_rank=1)]}, "t")
    assert one.lookup("expand", 1, 1, 1, 1) == ExpandTile(64, 4)  # every positive count and dimension
    assert tiles.lookup("expand", 70, 2, 64, 31) is None
    assert tiles.lookup("expand", 70, 2, 64, 32) == tiles.lookup("expand", 70, 2, 64, 100) == ExpandTile(64, 4)
    # another shape, stack or capacity has no entry: the kernels keep their built-in tile
    assert tiles.lookup("shrink", 520, 1, 64, 8) is None and tiles.lookup("shrink", 4096, 2, 64, 8) is None
    assert tiles.lookup("shrink", 520, 2, 16, 8) is None and tiles.lookup("expand", 70, 2, 16, 8) is None


BAD = [
    ([], "expected an object"),
    ({"entries": {}}, "expected an object"),
    ({"entries": [7]}, "entry 0: not an object"),
    ({"entries": [{**shrink_entry(8, 3), "kernel": "gemm"}]}, "unknown kernel 'gemm'"),
    ({"entries": [shrink_entry(8, 0)]}, "'num_programs' must be 1-2048"),
    ({"entries": [shrink_entry(8, 2049)]}, "'num_programs' must be 1-2048"),
    ({"entries": [shrink_entry(8, True)]}, "'num_programs' must be 1-2048"),
    ({"entries": [shrink_entry(8, 3, block_k=96)]}, "'block_k' must be one of"),
    ({"entries": [shrink_entry(8, 3, block_k=32)]}, "'block_k' must be one of (64, 128, 256)"),  # splits x T x R
    ({"entries": [sgmv_entry("sgmv_shrink", 64, 8, 64, 16, 64, num_stages=5)]}, "'num_stages' must be one of"),
    ({"entries": [sgmv_entry("sgmv_expand", 64, 8, 128, 256, 128, num_stages=3)]}, "bytes of shared memory, over"),
    ({"entries": [shrink_entry(8, 3, num_warps=3)]}, "'num_warps' must be one of"),
    ({"entries": [sgmv_entry("sgmv_shrink", 64, 8, 64, 16, 64, split_k=3)]}, "'split_k' must be one of (1, 2, 4, 8, 16)"),
    ({"entries": [sgmv_entry("sgmv_shrink", 64, 8, 64, 16, 64, split_k=0)]}, "'split_k' must be one of"),
    ({"entries": [sgmv_entry("sgmv_expand", 64, 8, 64, 16, 16, split_k=2)]}, "'split_k' must be one of (1,)"),
    ({"entries": [expand_entry(8, 100)]}, "'block_n' must be one of"),
    ({"entries": [{**expand_entry(8, 64), "kernel": "sgmv_expand"}]}, "'block_m'"),
    ({"entries": [expand_entry(-1, 64)]}, "'tokens' must be a positive integer"),
    ({"entries": [expand_entry(0, 64)]}, "'tokens' must be a positive integer"),
    ({"entries": [{k: v for k, v in shrink_entry(8, 3).items() if k != "in_dim"}]}, "'in_dim'"),
    ({"entries": [{**shrink_entry(8, 3), "config": [1]}]}, "'config' is not an object"),
    ({"entries": [shrink_entry(8, 3), expand_entry(8, 64), shrink_entry(8, 4)]}, "entry 2: a second entry"),
]


@pytest.mark.parametrize("doc, message", BAD, ids=[m for _, m in BAD])
def test_a_bad_file_is_refused_whole_with_its_name_and_entry(doc, message):
    """Bad JSON shapes, and tiles the kernels cannot run: too many decode programs or splits, shared
    memory past what a block gets."""
    with pytest.raises(ValueError, match=r"^tiles\.json: ") as info:
        tuned.parse(doc, "tiles.json")
    assert message in str(info.value)


def test_files_are_read_from_the_directory_given_and_again_after_a_change(tuned_dir):
    device = torch.device("cpu")
    assert len(tuned.device_tiles(device)) == 0 and tuned.describe(device) == "built-in"  # no file for this device
    write_tiles(tuned_dir, [shrink_entry(8, 3)], "cpu")
    tuned.use_dir(tuned_dir)
    assert tuned.device_tiles(device).lookup("shrink", 520, 2, 64, 9) == ShrinkTile(3, 128, 4)
    assert tuned.describe(device) == f"{tuned_dir / 'cpu.json'} (1 entries)"
    (tuned_dir / "cpu.json").write_text("{not json")
    tuned.use_dir(tuned_dir)
    with pytest.raises(ValueError, match=r"cpu\.json: not JSON"):
        tuned.device_tiles(device)
    tuned.use_dir(None)
    assert tuned.config_dir() == tuned.DEFAULT_DIR and not (tuned.DEFAULT_DIR / "cpu.json").exists()
    assert len(tuned.device_tiles(device)) == 0


def test_decode_config_takes_the_tuned_tile_and_a_forced_program_count_over_it(tuned_dir):
    device = torch.device(DEVICE)
    builtin = sgmv_decode.decode_config(520, 2, device, max_rank=64, num_tokens=8)
    assert (builtin["block_k"], builtin["num_warps"]) == (sgmv_decode.BLOCK_K, 4)
    write_tiles(tuned_dir, [shrink_entry(8, 3, block_k=64, num_warps=2)])
    tuned.use_dir(tuned_dir)
    config = sgmv_decode.decode_config(520, 2, device, max_rank=64, num_tokens=8)
    assert config == {"num_programs": 3, "block_k": 64, "num_warps": 2, "max_splits": 3}
    forced = sgmv_decode.decode_config(520, 2, device, 40, max_rank=64, num_tokens=8)
    assert forced == {"num_programs": 40, "block_k": 64, "num_warps": 2, "max_splits": 9}  # cdiv(520, 64)
    assert sgmv_decode.decode_config(520, 2, device, max_rank=64, num_tokens=7) == builtin  # below every tuned count
    tile = ShrinkTile(5, 256, 8)
    assert sgmv_decode.decode_config(520, 2, device, max_rank=64, num_tokens=8, tile=tile)["max_splits"] == 3


class Spy:
    """A Triton kernel whose launches (grid, meta-parameters) are recorded, then run."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


BUILTIN_SHRINK = (sgmv_decode.builtin_shrink_tile(2, torch.device(DEVICE)).num_programs, sgmv_decode.BLOCK_K, 4)


@pytest.mark.parametrize(
    "batch, num_programs, block_k, num_warps", [(5, *BUILTIN_SHRINK), (12, 3, 64, 2), (40, 3, 64, 2), (100, 6, 256, 8)]
)
def test_the_shrink_launches_with_the_tuned_tile_and_matches_fp64(
    tuned_dir, monkeypatch, batch, num_programs, block_k, num_warps
):
    write_tiles(
        tuned_dir,
        [shrink_entry(8, 3, block_k=64, num_warps=2), shrink_entry(64, 6, block_k=256, num_warps=8)],
    )
    tuned.use_dir(tuned_dir)
    split, reduce = Spy(sgmv_decode._shrink_split_kernel), Spy(sgmv_decode._shrink_reduce_kernel)
    monkeypatch.setattr(sgmv_decode, "_shrink_split_kernel", split)
    monkeypatch.setattr(sgmv_decode, "_shrink_reduce_kernel", reduce)
    seg_lens, slots, ranks = decode_batch("zipf", batch, num_adapters=4, seed=batch)
    assert (
        check_shrink(
            sgmv_decode.sgmv_shrink_decode,
            torch.bfloat16,
            520,
            2,
            *merged(seg_lens, slots),
            ranks,
            seed=batch,
        )
        > 0
    )
    [(grid, kwargs)] = split.launches
    assert grid == (num_programs, 2) and kwargs["BLOCK_K"] == block_k and kwargs["num_warps"] == num_warps
    [(_, reduce_kwargs)] = reduce.launches
    assert reduce_kwargs["BLOCK_K"] == block_k  # the reduce finds the splits the split kernel wrote


def test_the_expand_and_the_delta_launch_with_the_tuned_tile_and_match_fp64(tuned_dir, monkeypatch):
    write_tiles(tuned_dir, [expand_entry(16, 16, num_warps=1)])
    tuned.use_dir(tuned_dir)
    spy = Spy(sgmv_decode._expand_decode_kernel)
    monkeypatch.setattr(sgmv_decode, "_expand_decode_kernel", spy)
    seg_lens, slots, ranks = decode_batch("uniform", 20, num_adapters=5, seed=1)
    meta = check_expand(
        sgmv_decode.sgmv_expand_decode, torch.float32, seg_lens, slots, ranks, ((0, 70), (70, 70)), 140
    )
    [(grid, kwargs)] = spy.launches
    assert (
        grid == (meta.num_segments, 10) and kwargs["BLOCK_N"] == 16 and kwargs["num_warps"] == 1
    )  # two targets of cdiv(70, 16) blocks
    # the decode delta (what a decode step's side stream runs) takes the same tile
    v = torch.randn(20, 2 * 64, device=DEVICE)
    B = torch.randn(len(ranks), 140, 64, device=DEVICE)
    delta = sgmv_decode.sgmv_delta_auto(v, B, meta, output_slices=((0, 70), (70, 70)))
    assert spy.launches[-1][1]["BLOCK_N"] == 16
    want = torch.zeros_like(delta)
    sgmv_decode.sgmv_expand_decode(
        v, B, meta, want, output_slices=((0, 70), (70, 70)), tile=ExpandTile(128, 4)
    )
    torch.testing.assert_close(delta, want, rtol=1e-4, atol=1e-4)


def test_the_expand_launches_each_target_s_own_column_blocks(tuned_dir, monkeypatch):
    """q/k/v-like slices of unequal widths: the grid's second axis is the targets' blocks end to end
    (5 + 2 + 2 of 16 columns), not the widest target's blocks for each, and every column is written."""
    write_tiles(tuned_dir, [expand_entry(16, 16, num_warps=1, num_stack=3, out_dim=70)])
    tuned.use_dir(tuned_dir)
    spy = Spy(sgmv_decode._expand_decode_kernel)
    monkeypatch.setattr(sgmv_decode, "_expand_decode_kernel", spy)
    seg_lens, slots, ranks = decode_batch("zipf", 24, num_adapters=4, seed=2)
    meta = check_expand(
        sgmv_decode.sgmv_expand_decode, torch.float32, seg_lens, slots, ranks, ((0, 70), (70, 30), (100, 30)), 130
    )
    [(grid, kwargs)] = spy.launches
    assert grid == (meta.num_segments, 9) and kwargs["BLOCK_N"] == 16


@pytest.mark.parametrize("shrink_block_m, launched_m", [(32, 32), (128, 64)], ids=["tile_rows", "segments_shorter"])
def test_prefill_kernels_launch_with_the_tuned_tile_and_match_fp64(tuned_dir, monkeypatch, shrink_block_m, launched_m):
    """lorakernels/sgmv.py's shrink and expand (prefill-sized steps) take the tuned tile of their shape; a
    tile's rows apply where the step's longest segment (33 rows here) has them, else the built-in rows."""
    from lorakernels import sgmv
    from tests.lorakernels.test_sgmv import run_case

    write_tiles(tuned_dir, [
        sgmv_entry("sgmv_shrink", 64, 32, shrink_block_m, 16, 32, num_warps=2, num_stages=2),
        sgmv_entry("sgmv_expand", 64, 32, 16, 32, 16, num_warps=8, num_stages=3),
    ])  # fmt: skip
    tuned.use_dir(tuned_dir)
    spy = Spy(sgmv._sgmv_kernel)
    monkeypatch.setattr(sgmv, "_sgmv_kernel", spy)
    delta = run_case("triton", torch.bfloat16, "qkv", "skewed", num_reqs=6, num_tokens=40)
    assert delta.abs().max() > 0.1
    [(_, shrink), (_, expand)] = spy.launches
    assert shrink["IS_SHRINK"] and not expand["IS_SHRINK"]
    tile = {k: shrink[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")}
    assert tile == {"BLOCK_M": launched_m, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 2, "num_stages": 2}
    tile = {k: expand[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")}
    assert tile == {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "num_warps": 8, "num_stages": 3}


def test_a_prefill_shrink_tile_may_split_in_dim_and_leaves_out_split_k_as_one():
    tiles = tuned.parse({"entries": [
        sgmv_entry("sgmv_shrink", 64, 8, 64, 16, 64, split_k=4),
        sgmv_entry("sgmv_shrink", 64, 256, 64, 16, 64),
        sgmv_entry("sgmv_expand", 64, 8, 64, 16, 16, split_k=1),
    ]}, "t")  # fmt: skip
    assert tiles.lookup("sgmv_shrink", 64, 3, 128, 8) == tuned.SgmvTile(64, 16, 64, 4, 2, split_k=4)
    assert tiles.lookup("sgmv_shrink", 64, 3, 128, 300).split_k == 1
    assert tiles.lookup("sgmv_expand", 64, 3, 128, 8).split_k == 1


def test_a_tuned_split_shrink_launches_split_with_its_sum_and_matches_fp64(tuned_dir, monkeypatch):
    """A prefill shrink whose tuned tile splits in_dim launches its programs over a third grid axis of
    split_k and the sum kernel after it; an in_dim of one K tile is not split (nothing to split)."""
    from lorakernels import sgmv
    from tests.lorakernels.test_sgmv import run_case

    write_tiles(tuned_dir, [sgmv_entry("sgmv_shrink", 176, 32, 32, 16, 32, num_stack=1, split_k=4)])  # 176: 6 K tiles
    tuned.use_dir(tuned_dir)
    launches, sums = Spy(sgmv._sgmv_kernel), Spy(sgmv._split_sum_kernel)
    monkeypatch.setattr(sgmv, "_sgmv_kernel", launches)
    monkeypatch.setattr(sgmv, "_split_sum_kernel", sums)
    delta = run_case("triton", torch.bfloat16, "single", "zipf", num_reqs=6, num_tokens=40)
    assert delta.abs().max() > 0.1
    [(grid, shrink), (_, expand)] = launches.launches
    assert shrink["IS_SHRINK"] and shrink["SPLIT_K"] == 4 and grid[2] == 4 and expand["SPLIT_K"] == 1
    [(sum_grid, summed)] = sums.launches
    assert summed["SPLIT_K"] == 4 and sum_grid == grid[:2]
    write_tiles(tuned_dir, [sgmv_entry("sgmv_shrink", 176, 32, 32, 16, 256, num_stack=1, split_k=4)])  # one K tile
    tuned.use_dir(tuned_dir)
    launches.launches.clear()
    run_case("triton", torch.bfloat16, "single", "zipf", num_reqs=6, num_tokens=40)
    assert launches.launches[0][1]["SPLIT_K"] == 1 and len(sums.launches) == 1


@pytest.mark.parametrize("kernel", sorted(tuned.KINDS))
def test_every_allowed_value_of_every_field_parses_and_its_neighbours_do_not(kernel):
    """The parser's choices are exactly the tables in lorakernels/tuned.py (a changed bound is a changed test),
    and tiles are hashable: the tuner keys its timings by them."""
    shape_keys, tile_class, fields = tuned.KINDS[kernel]
    least = {name: min(choices) for name, choices in fields.items()}
    for name, choices in fields.items():
        for value in (*choices, max(choices) + 1, min(choices) - 1):
            entry = {"kernel": kernel, **dict.fromkeys(shape_keys, 64), "tokens": 8, "config": {**least, name: value}}
            if value in choices:
                tile = tuned.parse({"entries": [entry]}, "t").lookup(kernel, 64, 64, 64, 8)
                assert tile == tile_class(**{**least, name: value}) and hash(tile) == hash(tile_class(**{**least, name: value}))
            else:
                with pytest.raises(ValueError, match=name):
                    tuned.parse({"entries": [entry]}, "t")
    big = {"block_m": 128, "block_n": 256, "block_k": 256, "num_warps": 8, "num_stages": 4}
    assert tuned.SgmvTile(**big).smem_bytes == 4 * (128 * 256 + 256 * 256) * 2 > tuned.SGMV_SMEM_BYTES
    assert tuned.SgmvTile(**{**big, "num_stages": 1, "block_m": 64, "block_n": 64}).smem_bytes <= tuned.SGMV_SMEM_BYTES


def test_the_allowed_tile_sizes_are_what_the_kernels_take():
    """Block sizes are powers of two from 16 (tl.arange's lengths, tl.dot's least side) to 256, warps a
    power of two; a decode shrink's K tile at least 64 (its split workspace)."""
    for _, _, fields in tuned.KINDS.values():
        for name, choices in fields.items():
            if name.startswith("block_"):
                assert all(16 <= c <= 256 and c & (c - 1) == 0 for c in choices), name
            elif name == "num_warps":
                assert all(c & (c - 1) == 0 for c in choices)
            elif name == "num_stages":
                assert min(choices) == 1 and max(choices) <= 4
    assert min(tuned.KINDS["shrink"][2]["block_k"]) == 64


def test_the_shipped_files_parse_and_are_named_for_their_device():
    """Every file in lorakernels/configs is one the engine will take whole (a broken entry would refuse the
    file at the worker's start) and sits under the name its device's lookup reads."""
    files = sorted(tuned.DEFAULT_DIR.glob("*.json"))
    assert "NVIDIA_H200.json" in [f.name for f in files]
    for path in files:
        doc = json.loads(path.read_text())
        assert path.name == tuned.device_file_name(doc["device"])
        assert len(tuned.load_file(path)) == len(doc["entries"]) > 0
