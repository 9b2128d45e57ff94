"""The command line a newcomer meets: every flag explained with its default, messages that name the
field and say what to do, and terminal output that cannot garble the terminal."""

from __future__ import annotations

import argparse

import pytest

from engine.config import DEFAULT_ADAPTER_PREP_THREADS, EngineConfig
from loramux.shell import cli
from loramux.shell.commands import human_bytes, printable


def _parsers(parser: argparse.ArgumentParser, path=()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_every_command_and_flag_has_a_description_and_its_default():
    for path, parser in _parsers(cli.build_parser({})):
        if not path:
            continue
        assert parser.description, f"loramux {' '.join(path)} has no description"
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
                continue
            assert action.help, f"loramux {' '.join(path)}: {action.dest} has no help"
            if action.option_strings and action.default not in (None, "", False, []):
                assert f"default: {action.default}" in text or "default" in action.help, (
                    f"loramux {' '.join(path)}: {action.option_strings[0]} does not show its default"
                )


def test_up_help_names_the_data_dir_ports_and_variables():
    up = dict(_parsers(cli.build_parser({})))[("up",)].format_help().replace("\n", " ")
    for needle in ("~/.loramux", "50051", "50052", "8000", "LORAMUX_", "--detach", "loramux down"):
        assert needle in up, needle


def test_drain_help_says_how_to_turn_it_off():
    up = dict(_parsers(cli.build_parser({})))[("up",)].format_help().replace("\n", " ")
    assert "0 turns it off" in " ".join(up.split())


def test_lora_load_ahead_reaches_the_engine_config_from_the_flag_or_its_variable():
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]
    assert engine_config(cli.build_parser({}).parse_args(serve), "m", 0).lora_load_ahead == 2
    args = cli.build_parser({"LORAMUX_LORA_LOAD_AHEAD": "5"}).parse_args(serve)
    assert engine_config(args, "m", 0).lora_load_ahead == 5
    args = cli.build_parser({"LORAMUX_LORA_LOAD_AHEAD": "5"}).parse_args([*serve, "--lora-load-ahead", "0"])
    assert engine_config(args, "m", 0).lora_load_ahead == 0


def test_fetch_cap_reaches_the_engine_config_from_the_flag_or_its_variable():
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]
    assert engine_config(cli.build_parser({}).parse_args(serve), "m", 0).max_concurrent_fetches == 4
    args = cli.build_parser({"LORAMUX_MAX_CONCURRENT_FETCHES": "9"}).parse_args(serve)
    assert engine_config(args, "m", 0).max_concurrent_fetches == 9
    args = cli.build_parser({}).parse_args([*serve, "--max-concurrent-fetches", "1"])
    assert engine_config(args, "m", 0).max_concurrent_fetches == 1
    with pytest.raises(ValueError, match="max_concurrent_fetches"):
        EngineConfig(model_dir="m", max_concurrent_fetches=0)


def test_the_fetch_process_is_on_unless_the_flag_or_its_variable_turns_it_off():
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]
    assert engine_config(cli.build_parser({}).parse_args(serve), "m", 0).disable_fetch_process is False
    assert engine_config(cli.build_parser({}).parse_args([*serve, "--disable-fetch-process"]), "m", 0).disable_fetch_process is True
    args = cli.build_parser({"LORAMUX_DISABLE_FETCH_PROCESS": "1"}).parse_args(serve)
    assert engine_config(args, "m", 0).disable_fetch_process is True


def test_fetch_processes_reach_the_engine_config_from_the_flag_or_its_variable():
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]
    assert engine_config(cli.build_parser({}).parse_args(serve), "m", 0).fetch_processes == 1
    args = cli.build_parser({"LORAMUX_FETCH_PROCESSES": "3"}).parse_args(serve)
    assert engine_config(args, "m", 0).fetch_processes == 3
    args = cli.build_parser({"LORAMUX_FETCH_PROCESSES": "3"}).parse_args([*serve, "--fetch-processes", "2"])
    assert engine_config(args, "m", 0).fetch_processes == 2
    with pytest.raises(SystemExit):
        cli.build_parser({}).parse_args([*serve, "--fetch-processes", "0"])
    with pytest.raises(ValueError, match="fetch_processes"):
        EngineConfig(model_dir="m", fetch_processes=0)


def test_adapter_prep_threads_reach_the_engine_config_from_the_flag_or_its_variable():
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]
    assert engine_config(cli.build_parser({}).parse_args(serve), "m", 0).adapter_prep_threads == DEFAULT_ADAPTER_PREP_THREADS == 4
    args = cli.build_parser({"LORAMUX_ADAPTER_PREP_THREADS": "3"}).parse_args(serve)
    assert engine_config(args, "m", 0).adapter_prep_threads == 3
    args = cli.build_parser({"LORAMUX_ADAPTER_PREP_THREADS": "3"}).parse_args([*serve, "--adapter-prep-threads", "2"])
    assert engine_config(args, "m", 0).adapter_prep_threads == 2
    with pytest.raises(ValueError, match="adapter_prep_threads"):
        EngineConfig(model_dir="m", adapter_prep_threads=0)


def test_host_pinned_memory_reaches_the_engine_config_from_the_flag_or_its_variable():
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]
    assert engine_config(cli.build_parser({}).parse_args(serve), "m", 0).host_pinned_gb is None  # auto
    for text, gb in (("auto", None), ("0", 0)):
        assert engine_config(cli.build_parser({"LORAMUX_HOST_PINNED_GB": text}).parse_args(serve), "m", 0).host_pinned_gb == gb
    for bad in ("-1", "inf", "lots"):
        with pytest.raises(SystemExit):
            cli.build_parser({}).parse_args([*serve, "--host-pinned-gb", bad])
    args = cli.build_parser({"LORAMUX_HOST_PINNED_GB": "2.5"}).parse_args(serve)
    assert engine_config(args, "m", 0).host_pinned_gb == 2.5
    args = cli.build_parser({}).parse_args([*serve, "--host-pinned-gb", "8"])
    assert engine_config(args, "m", 0).host_pinned_gb == 8
    with pytest.raises(ValueError, match="host_pinned_gb"):
        EngineConfig(model_dir="m", host_pinned_gb=-1)


def test_lora_sm_carveout_reaches_the_engine_config_from_the_flag_or_its_variable():
    from engine.config import DEFAULT_LORA_SM_CARVEOUT
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]
    assert engine_config(cli.build_parser({}).parse_args(serve), "m", 0).lora_sm_carveout == DEFAULT_LORA_SM_CARVEOUT == 48
    args = cli.build_parser({"LORAMUX_LORA_SM_CARVEOUT": "16"}).parse_args(serve)
    assert engine_config(args, "m", 0).lora_sm_carveout == 16
    args = cli.build_parser({}).parse_args([*serve, "--lora-sm-carveout", "0"])
    assert engine_config(args, "m", 0).lora_sm_carveout == 0
    with pytest.raises(ValueError, match="lora_sm_carveout"):
        EngineConfig(model_dir="m", lora_sm_carveout=-1)


def test_lora_sm_carveout_targets_reach_the_engine_config_from_the_flag_or_its_variable(capsys):
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]
    assert engine_config(cli.build_parser({}).parse_args(serve), "m", 0).lora_sm_carveout_targets == ()
    args = cli.build_parser({}).parse_args([*serve, "--lora-sm-carveout-target", "gate_up=0", "down=24"])
    assert engine_config(args, "m", 0).lora_sm_carveout_targets == (("gate_up", 0), ("down", 24))
    args = cli.build_parser({"LORAMUX_LORA_SM_CARVEOUT_TARGET": "qkv=16"}).parse_args(serve)
    assert engine_config(args, "m", 0).lora_sm_carveout_targets == (("qkv", 16),)
    for bad in ("mlp=8", "gate_up", "gate_up=-1", "gate_up=2000"):
        with pytest.raises(SystemExit):
            cli.build_parser({}).parse_args([*serve, "--lora-sm-carveout-target", bad])
        err = capsys.readouterr().err
        assert "TARGET=SMS" in err or "0..1024" in err, err
    with pytest.raises(ValueError, match="each of qkv, o, gate_up, down once"):
        EngineConfig(model_dir="m", lora_sm_carveout_targets=(("gate_up", 0), ("gate_up", 8)))
    with pytest.raises(ValueError, match="each of qkv, o, gate_up, down once"):
        EngineConfig(model_dir="m", lora_sm_carveout_targets=(("lm_head", 0),))
    with pytest.raises(ValueError, match="0-1024 SMs each"):
        EngineConfig(model_dir="m", lora_sm_carveout_targets=(("o", 1025),))


def test_lora_decode_fused_expand_reaches_the_engine_config_from_the_flag_or_its_variable():
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]
    assert engine_config(cli.build_parser({}).parse_args(serve), "m", 0).lora_decode_fused_expand == ()
    args = cli.build_parser({}).parse_args([*serve, "--lora-decode-fused-expand", "gate_up", "qkv"])
    assert engine_config(args, "m", 0).lora_decode_fused_expand == ("gate_up", "qkv")
    args = cli.build_parser({"LORAMUX_LORA_DECODE_FUSED_EXPAND": "qkv"}).parse_args(serve)
    assert engine_config(args, "m", 0).lora_decode_fused_expand == ("qkv",)
    with pytest.raises(SystemExit):
        cli.build_parser({}).parse_args([*serve, "--lora-decode-fused-expand", "down"])
    with pytest.raises(ValueError, match="lora_decode_fused_expand takes qkv, gate_up"):
        EngineConfig(model_dir="m", lora_decode_fused_expand=("o",))


def test_lora_decode_fused_delta_reaches_the_engine_config_and_refuses_a_target_fused_both_ways():
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]
    assert engine_config(cli.build_parser({}).parse_args(serve), "m", 0).lora_decode_fused_delta == ()
    args = cli.build_parser({}).parse_args([*serve, "--lora-decode-fused-delta", "o", "down", "qkv"])
    assert engine_config(args, "m", 0).lora_decode_fused_delta == ("o", "down", "qkv")
    args = cli.build_parser({"LORAMUX_LORA_DECODE_FUSED_DELTA": "gate_up down"}).parse_args(serve)
    assert engine_config(args, "m", 0).lora_decode_fused_delta == ("gate_up", "down")
    with pytest.raises(SystemExit):
        cli.build_parser({}).parse_args([*serve, "--lora-decode-fused-delta", "lm_head"])
    with pytest.raises(ValueError, match="lora_decode_fused_delta takes qkv, o, gate_up, down"):
        EngineConfig(model_dir="m", lora_decode_fused_delta=("q_proj",))
    with pytest.raises(ValueError, match="gate_up cannot be in both"):
        EngineConfig(model_dir="m", lora_decode_fused_delta=("o", "gate_up"), lora_decode_fused_expand=("gate_up",))
    EngineConfig(model_dir="m", lora_decode_fused_delta=("o", "down"), lora_decode_fused_expand=("qkv", "gate_up"))


def test_lora_decode_norm_shrink_reaches_the_engine_config_and_refuses_a_target_fused_both_ways():
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]
    assert engine_config(cli.build_parser({}).parse_args(serve), "m", 0).lora_decode_norm_shrink == ()
    args = cli.build_parser({}).parse_args([*serve, "--lora-decode-norm-shrink", "gate_up", "qkv"])
    assert engine_config(args, "m", 0).lora_decode_norm_shrink == ("gate_up", "qkv")
    args = cli.build_parser({"LORAMUX_LORA_DECODE_NORM_SHRINK": "qkv"}).parse_args(serve)
    assert engine_config(args, "m", 0).lora_decode_norm_shrink == ("qkv",)
    with pytest.raises(SystemExit):  # o's and down's inputs come from no norm
        cli.build_parser({}).parse_args([*serve, "--lora-decode-norm-shrink", "o"])
    with pytest.raises(ValueError, match="lora_decode_norm_shrink takes qkv, gate_up"):
        EngineConfig(model_dir="m", lora_decode_norm_shrink=("down",))
    with pytest.raises(ValueError, match="qkv cannot be in both lora_decode_fused_delta"):
        EngineConfig(model_dir="m", lora_decode_fused_delta=("qkv", "o"), lora_decode_norm_shrink=("qkv",))
    EngineConfig(model_dir="m", lora_decode_fused_delta=("o", "down"), lora_decode_norm_shrink=("qkv", "gate_up"))


def test_the_pdl_switches_reach_the_engine_config_from_their_flags_or_variables():
    """--kernel-pdl is off unless asked for; the LoRA chain's PDL is on unless --disable-lora-pdl; each
    flag moves its own switch only."""
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]

    def switches(argv: list[str], env: dict[str, str] | None = None) -> tuple[bool, bool]:
        config = engine_config(cli.build_parser(env or {}).parse_args([*serve, *argv]), "m", 0)
        return config.kernel_pdl, config.lora_pdl

    assert switches([]) == (False, True)
    assert switches(["--kernel-pdl"]) == (True, True)
    assert switches(["--disable-lora-pdl"]) == (False, False)
    assert switches([], {"LORAMUX_KERNEL_PDL": "1"}) == (True, True)
    assert switches([], {"LORAMUX_KERNEL_PDL": "0", "LORAMUX_DISABLE_LORA_PDL": "1"}) == (False, False)
    assert switches([], {"LORAMUX_DISABLE_LORA_PDL": "false"}) == (False, True)


def test_decode_gemm_tuning_is_on_unless_disabled_by_flag_or_variable():
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]

    def tuned(argv: list[str], env: dict[str, str] | None = None) -> bool:
        return engine_config(cli.build_parser(env or {}).parse_args([*serve, *argv]), "m", 0).tune_decode_gemms

    assert tuned([])
    assert not tuned(["--disable-decode-gemm-tuning"])
    assert not tuned([], {"LORAMUX_DISABLE_DECODE_GEMM_TUNING": "1"})
    assert tuned([], {"LORAMUX_DISABLE_DECODE_GEMM_TUNING": "0"})


def test_lora_prefill_fused_expand_reaches_the_engine_config_from_the_flag_or_its_variable():
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]
    assert engine_config(cli.build_parser({}).parse_args(serve), "m", 0).lora_prefill_fused_expand == ("gate_up",)
    args = cli.build_parser({}).parse_args([*serve, "--lora-prefill-fused-expand", "gate_up", "o", "down"])
    assert engine_config(args, "m", 0).lora_prefill_fused_expand == ("gate_up", "o", "down")
    args = cli.build_parser({}).parse_args([*serve, "--lora-prefill-fused-expand"])
    assert engine_config(args, "m", 0).lora_prefill_fused_expand == ()
    args = cli.build_parser({"LORAMUX_LORA_PREFILL_FUSED_EXPAND": "o down"}).parse_args(serve)
    assert engine_config(args, "m", 0).lora_prefill_fused_expand == ("o", "down")
    with pytest.raises(SystemExit):
        cli.build_parser({}).parse_args([*serve, "--lora-prefill-fused-expand", "qkv"])
    with pytest.raises(ValueError, match="lora_prefill_fused_expand takes gate_up, o, down"):
        EngineConfig(model_dir="m", lora_prefill_fused_expand=("qkv",))


def test_lora_graph_segments_reach_the_engine_config_from_the_flag_or_its_variable():
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]
    assert engine_config(cli.build_parser({}).parse_args(serve), "m", 0).lora_graph_segments == ()
    args = cli.build_parser({}).parse_args([*serve, "--lora-graph-segments", "4", "16"])
    assert engine_config(args, "m", 0).lora_graph_segments == (4, 16)
    args = cli.build_parser({"LORAMUX_LORA_GRAPH_SEGMENTS": "8 32"}).parse_args(serve)
    assert engine_config(args, "m", 0).lora_graph_segments == (8, 32)
    with pytest.raises(ValueError, match="lora_graph_segments must be positive"):
        EngineConfig(model_dir="m", lora_graph_segments=(4, 0))


def test_lora_gemm_tail_blocks_reaches_the_engine_config_from_the_flag_or_its_variable():
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]
    assert engine_config(cli.build_parser({}).parse_args(serve), "m", 0).lora_gemm_tail_blocks == 4
    args = cli.build_parser({}).parse_args([*serve, "--lora-gemm-tail-blocks", "0"])
    assert engine_config(args, "m", 0).lora_gemm_tail_blocks == 0
    args = cli.build_parser({"LORAMUX_LORA_GEMM_TAIL_BLOCKS": "8"}).parse_args(serve)
    assert engine_config(args, "m", 0).lora_gemm_tail_blocks == 8
    with pytest.raises(ValueError, match="lora_gemm_tail_blocks must be 0-64"):
        EngineConfig(model_dir="m", lora_gemm_tail_blocks=65)
    with pytest.raises(ValueError, match="lora_gemm_tail_blocks must be 0-64"):
        EngineConfig(model_dir="m", lora_gemm_tail_blocks=-1)


def test_linear_weight_layout_reaches_the_engine_config_from_the_flag_or_its_variable():
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]
    assert engine_config(cli.build_parser({}).parse_args(serve), "m", 0).linear_weight_layout == "in_out"
    assert EngineConfig(model_dir="m").linear_weight_layout == "in_out"
    args = cli.build_parser({}).parse_args([*serve, "--linear-weight-layout", "out_in"])
    assert engine_config(args, "m", 0).linear_weight_layout == "out_in"
    args = cli.build_parser({"LORAMUX_LINEAR_WEIGHT_LAYOUT": "out_in"}).parse_args(serve)
    assert engine_config(args, "m", 0).linear_weight_layout == "out_in"
    with pytest.raises(SystemExit):
        cli.build_parser({}).parse_args([*serve, "--linear-weight-layout", "transposed"])
    with pytest.raises(ValueError, match="linear_weight_layout must be one of out_in, in_out, got 'io'"):
        EngineConfig(model_dir="m", linear_weight_layout="io")


def test_gil_switch_interval_reaches_the_engine_config_from_the_flag_or_its_variable():
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]
    assert engine_config(cli.build_parser({}).parse_args(serve), "m", 0).gil_switch_interval_ms == 0
    args = cli.build_parser({}).parse_args([*serve, "--gil-switch-interval-ms", "0.5"])
    assert engine_config(args, "m", 0).gil_switch_interval_ms == 0.5
    args = cli.build_parser({"LORAMUX_GIL_SWITCH_INTERVAL_MS": "1"}).parse_args(serve)
    assert engine_config(args, "m", 0).gil_switch_interval_ms == 1
    for bad in (-1, 101, float("nan")):
        with pytest.raises(ValueError, match="gil_switch_interval_ms"):
            EngineConfig(model_dir="m", gil_switch_interval_ms=bad)


def test_kernel_configs_reach_the_engine_config_from_the_flag_or_its_variable(tmp_path):
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]
    assert engine_config(cli.build_parser({}).parse_args(serve), "m", 0).kernel_configs == ""
    args = cli.build_parser({"LORAMUX_KERNEL_CONFIGS": str(tmp_path)}).parse_args(serve)
    assert engine_config(args, "m", 0).kernel_configs == str(tmp_path)
    args = cli.build_parser({}).parse_args(["up", "--kernel-configs", str(tmp_path)])
    assert args.kernel_configs == str(tmp_path)
    with pytest.raises(ValueError, match=r"kernel_configs .*missing.* is not a directory"):
        EngineConfig(model_dir="m", kernel_configs=str(tmp_path / "missing"))


def test_lora_target_modules_reach_the_engine_config_from_the_flag_or_its_variable():
    from loramux.shell.settings import engine_config

    serve = ["engine", "serve", "--model", "m"]
    assert engine_config(cli.build_parser({}).parse_args(serve), "m", 0).lora_target_modules == ()
    args = cli.build_parser({"LORAMUX_LORA_TARGET_MODULES": "q_proj v_proj"}).parse_args(serve)
    assert engine_config(args, "m", 0).lora_target_modules == ("q_proj", "v_proj")
    args = cli.build_parser({}).parse_args([*serve, "--lora-target-modules", "o_proj"])
    assert engine_config(args, "m", 0).lora_target_modules == ("o_proj",)
    args = cli.build_parser({}).parse_args(["up", "--lora-target-modules", "q_proj", "k_proj"])
    assert args.lora_target_modules == ["q_proj", "k_proj"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["generate", "--max-new-tokens", "99999999999", "x"], "--max-new-tokens"),
        (["engine", "serve", "--model", "m", "--lora-load-ahead", "-1"], "--lora-load-ahead"),
        (["up", "--max-concurrent-fetches", "0"], "--max-concurrent-fetches"),
        (["engine", "serve", "--model", "m", "--adapter-prep-threads", "0"], "--adapter-prep-threads"),
        (["engine", "serve", "--model", "m", "--lora-sm-carveout", "-1"], "--lora-sm-carveout"),
        (["generate", "--top-p", "0", "x"], "--top-p"),
        (["generate", "--temperature", "-1", "x"], "--temperature"),
        (["generate", "--seed", "-3", "x"], "--seed"),
    ],
)
def test_out_of_range_values_name_the_flag(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser({}).parse_args(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_generate_leaves_max_new_tokens_to_the_engine():
    args = cli.build_parser({}).parse_args(["generate", "x"])
    assert args.max_new_tokens is None  # the engine's default (256), not a second one here


def test_services_down_say_how_to_start_them(capsys):
    code = cli.main(["generate", "--engine", "127.0.0.1:1", "hi"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: UNAVAILABLE") and "loramux up --detach" in err
    assert len(err.strip().splitlines()) == 1


async def test_a_client_at_the_wrong_service_gets_a_hint(tmp_path, capsys):
    from tests.registry.harness import running_registry

    async with running_registry(tmp_path / "data") as registry:
        import asyncio

        code = await asyncio.to_thread(cli.main, ["generate", "--engine", registry.server.address, "hi"])
    err = capsys.readouterr().err
    assert code == 1 and "UNIMPLEMENTED" in err and "not a loramux engine" in err and "50052" in err


def test_generated_text_cannot_drive_the_terminal():
    assert printable("ok\x07\x1b[2J\x7f\x9b end\n\tnext") == "ok\\x07\\x1b[2J\\x7f\\x9b end\n\tnext"


def test_progress_units_fit_small_files():
    assert human_bytes(15_360) == "15.4 KB" and human_bytes(512) == "512 B" and human_bytes(3 << 30) == "3.2 GB"




def test_database_url_comes_from_a_file_without_a_password_on_the_command_line(tmp_path):
    from loramux.shell.settings import registry_config

    secret = tmp_path / "database_url"
    secret.write_text("postgresql+psycopg://loramux:s3cret@postgres:5432/loramux\n")
    for action in ("serve", "gc"):
        args = cli.build_parser({}).parse_args(["registry", action, "--database-url-file", str(secret)])
        assert registry_config(args).database_url == "postgresql+psycopg://loramux:s3cret@postgres:5432/loramux"
    both = cli.build_parser({"LORAMUX_DATABASE_URL": "sqlite:///x.db"}).parse_args(
        ["registry", "serve", "--database-url-file", str(secret)]
    )
    with pytest.raises(ValueError, match="not both"):
        registry_config(both)
    secret.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        registry_config(cli.build_parser({}).parse_args(["registry", "serve", "--database-url-file", str(secret)]))
    with pytest.raises(FileNotFoundError):
        registry_config(cli.build_parser({}).parse_args(["registry", "serve", "--database-url-file", str(tmp_path / "absent")]))


def test_a_missing_database_url_file_is_a_one_line_error(tmp_path, capsys):
    assert cli.main(["registry", "gc", "--data-dir", str(tmp_path), "--database-url-file", str(tmp_path / "absent")]) == 1
    assert "absent" in capsys.readouterr().err
