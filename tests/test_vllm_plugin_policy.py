"""The vLLM plugin's decisions that need no vLLM (``hlserve.integrations.plugin_policy``):
options and their two channels, the version pin, request classes, the caps of one step,
backpressure and the start-up block. The plugin in a real vLLM: tests/test_vllm_plugin.py."""

from __future__ import annotations

import pytest

from hlserve.integrations.plugin_policy import (
    INTERACTIVE_DECODING,
    INTERACTIVE_WAITING,
    NO_INTERACTIVE,
    PluginOptions,
    StepCaps,
    UnsupportedVLLMError,
    VLLMCaps,
    admitted_prefix,
    check_vllm_version,
    describe_caps,
    parse_options,
    projected_blocks,
    request_class,
    step_caps,
)


def test_defaults_are_throughput_modes() -> None:
    o = PluginOptions()
    assert (o.mixing, o.order, o.admission, o.budget_controller) == \
        ("two_stage", "lpm", "backpressure", "ema")
    assert (o.two_stage_high, o.two_stage_low, o.lpm_aging, o.budget_min) == (0.9, 0.7, 4.0, 256)
    assert (o.interactive_chunk_size, o.interactive_token_budget) == (512, 2048)


def test_options_from_env_and_additional_config_which_wins() -> None:
    env = {"HLSERVE_VLLM_LPM_AGING": "2", "HLSERVE_VLLM_BUDGET_MAX": "none",
           "HLSERVE_VLLM_TRACE": "/tmp/t.jsonl", "OTHER": "x"}
    o = parse_options({"hlserve": {"lpm_aging": 8, "interactive_chunk_size": None}}, env)
    assert o.lpm_aging == 8.0 and o.interactive_chunk_size is None
    assert o.budget_max is None and o.trace == "/tmp/t.jsonl"
    assert parse_options(None, {}) == PluginOptions()
    # where vLLM's environment is (set by .ci/run, inherited by vLLM) is not an option
    assert parse_options(None, {"HLSERVE_VLLM_PYTHON": "/venv/bin/python",
                                "HLSERVE_VLLM_VENV": "/venv"}) == PluginOptions()


@pytest.mark.parametrize("additional, env, match", [
    ({"hlserve": {"agin": 1}}, {}, "unknown hlserve option 'agin'"),
    ({}, {"HLSERVE_VLLM_AGIN": "1"}, "unknown hlserve option"),
    ({"hlserve": {"budget_min": 2.5}}, {}, "budget_min"),
    ({"hlserve": {"mixing": "sometimes"}}, {}, "mixing must be one of"),
    ({"hlserve": {"two_stage_low": 0.95}}, {}, "two_stage_low < two_stage_high"),
    ({"hlserve": [1]}, {}, "must be an object"),
])
def test_bad_options_are_errors(additional: dict, env: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_options(additional, env)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3", "0.32.1.dev4+gabc"])
def test_supported_vllm_versions(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "1.0.0", "dev"])
def test_other_vllm_versions_fail_with_the_fix(version: str) -> None:
    with pytest.raises(UnsupportedVLLMError, match=r"supports vLLM 0\.32\.x.*found"):
        check_vllm_version(version)


def test_request_class_by_xargs_then_priority_then_default() -> None:
    o = PluginOptions(interactive_priority=-1)
    assert request_class({"request_class": "interactive"}, 0, o) == "interactive"
    assert request_class({"request_class": "agent"}, -5, o) == "agent"
    assert request_class(None, -1, o) == "interactive"
    assert request_class({}, 0, o) == "agent"
    assert request_class(None, -9, PluginOptions()) == "agent"  # no priority rule by default


def test_step_caps_tighten_only_where_an_interactive_request_feels_them() -> None:
    o = PluginOptions()
    assert step_caps(8000.0, 8704, 0, 3, NO_INTERACTIVE, o) == StepCaps(8000, 0)  # greedy prefill
    assert step_caps(8000.0, 8704, 0, 3, INTERACTIVE_WAITING, o) == StepCaps(8000, 512)
    assert step_caps(8000.0, 8704, 0, 3, INTERACTIVE_DECODING, o) == StepCaps(2048, 512)
    assert step_caps(9000.0, 4096, 0, 0, NO_INTERACTIVE, o).token_budget == 4096  # hard cap
    assert step_caps(256.0, 8704, 0, 600, NO_INTERACTIVE, o).token_budget == 600  # decodes
    assert step_caps(8000.0, 8704, 1024, 0, NO_INTERACTIVE, o).chunk == 1024  # deployment's own


def test_projected_blocks_bounded_by_model_length_and_fair_share() -> None:
    # 2000-token prompt, 400 more tokens: 19 blocks of 128
    assert projected_blocks(2000, 400, 0, 128, 8704, 71, 0) == 19
    assert projected_blocks(2000, 400, 1024, 128, 8704, 71, 0) == 11  # 8 blocks cached
    # no max_tokens (the whole remaining context): bounded by the share, never below the prompt
    assert projected_blocks(2000, 6704, 0, 128, 8704, 71, 3) == 16 + 71 // 4
    assert projected_blocks(2000, 10**6, 0, 128, 4096, 1000, 0) == 32  # the model's length


def test_admitted_prefix_is_head_of_line_and_always_progresses() -> None:
    assert admitted_prefix([10, 10, 10], 25, 2) == 2
    assert admitted_prefix([30, 1, 1], 25, 2) == 0  # no overtaking the head
    assert admitted_prefix([30, 1], 25, 0) == 1  # nothing running: the head goes anyway
    assert admitted_prefix([], 25, 0) == 0


def test_start_up_block_lists_every_cap() -> None:
    caps = VLLMCaps("0.32.0", 2048, 256, 8704, 71, 128, 0, True, True)
    text = describe_caps(PluginOptions(), caps, 2048, 256, 2048)
    for name in ("chunk_size", "token_budget", "interactive_chunk_size",
                 "interactive_token_budget", "prefill_delay", "max_num_batched_tokens",
                 "max_num_seqs", "max_model_len", "kv_pool", "mixing=two_stage",
                 "order=lpm", "admission=backpressure"):
        assert name in text, name
    assert "below max_model_len" in text  # the hint to raise --max-num-batched-tokens
