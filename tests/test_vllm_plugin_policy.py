"""The vLLM plugin's decisions that need no vLLM (``hlserve.integrations.plugin_policy``):
options and their two channels, the version pin, request classes, the caps of one step,
backpressure and the start-up block. The plugin in a real vLLM: tests/test_vllm_plugin.py."""

from __future__ import annotations

import pytest

from hlserve.engine.policies.caps import (
    INTERACTIVE_DECODING,
    INTERACTIVE_WAITING,
    NO_INTERACTIVE,
    StepCaps,
    step_caps,
)
from hlserve.engine.policies.names import policy_names
from hlserve.engine.policies.order import FCFS
from hlserve.integrations.plugin_policy import (
    SUPPORTED,
    PluginOptions,
    PluginPolicy,
    UnsupportedVLLMError,
    VLLMCaps,
    VLLMKnobs,
    check_vllm_version,
    parse_options,
    plugin_config,
    request_class,
    vllm_knobs,
)
from plugin_views import NoPrefixCache, vreq

# the tests' vLLM: 71 usable blocks of 128 tokens, model length 8704, hard cap 2048
CAPS = VLLMCaps("0.32.0", "m", 2048, 256, 8704, 71, 128, 0, True, True)


def test_defaults_are_throughput_modes() -> None:
    c = PluginOptions().config
    assert (c.mixing, c.order, c.admission, c.budget_controller) == \
        ("two_stage", "lpm", "backpressure", "ema")
    assert (c.two_stage_high, c.two_stage_low, c.lpm_aging, c.budget_min) == (0.9, 0.7, 4.0, 256)
    assert (c.interactive_chunk_size, c.interactive_token_budget) == (512, 2048)
    assert c.chunk_size is None and c.token_budget is None


def test_the_plugin_runs_names_of_the_policy_registries() -> None:
    """What the plugin runs is a subset of each knob's registry (the names hlserve's command
    line lists and its configs are checked against), built by the registry's constructors."""
    for knob, names in SUPPORTED.items():
        assert set(names) <= set(policy_names(knob)), knob
    prefix = NoPrefixCache()
    assert PluginPolicy(PluginOptions(), CAPS, prefix).order is prefix  # lpm: the host's
    fcfs = PluginPolicy(parse_options({"hlserve": {"order": "fcfs"}}, {}), CAPS, prefix)
    assert isinstance(fcfs.order, FCFS)


def test_the_config_takes_vllms_own_settings() -> None:
    c = plugin_config(PluginOptions(), CAPS)
    assert (c.max_num_seqs, c.max_model_len, c.num_pages, c.page_size) == (256, 8704, 71, 128)
    assert c.chunk_size is None and c.budget_max == 2048  # the hard cap is the ceiling
    threshold = VLLMCaps("0.32.0", "m", 2048, 256, 8704, 71, 128, 1024, True, True)
    assert plugin_config(PluginOptions(), threshold).chunk_size == 1024
    lower = parse_options({"hlserve": {"budget_max": 1000}}, {})
    assert plugin_config(lower, CAPS).budget_max == 1000
    higher = parse_options({"hlserve": {"budget_max": 9000}}, {})
    assert plugin_config(higher, CAPS).budget_max == 2048


def test_options_from_env_and_additional_config_which_wins() -> None:
    env = {"HLSERVE_VLLM_LPM_AGING": "2", "HLSERVE_VLLM_BUDGET_MAX": "none",
           "HLSERVE_VLLM_TRACE": "/tmp/t.jsonl", "OTHER": "x"}
    o = parse_options({"hlserve": {"lpm_aging": 8, "interactive_chunk_size": None}}, env)
    assert o.config.lpm_aging == 8.0 and o.config.interactive_chunk_size is None
    assert o.config.budget_max is None and o.trace == "/tmp/t.jsonl"
    # "no cap" as hlserve spells it everywhere (config.parse_cap)
    for word in ("none", "unlimited", "inf", "off"):
        o = parse_options(None, {"HLSERVE_VLLM_INTERACTIVE_TOKEN_BUDGET": word})
        assert o.config.interactive_token_budget is None
    assert parse_options(None, {}) == PluginOptions()
    # where vLLM's environment is (set by .ci/run, inherited by vLLM) is not an option
    assert parse_options(None, {"HLSERVE_VLLM_PYTHON": "/venv/bin/python",
                                "HLSERVE_VLLM_VENV": "/venv"}) == PluginOptions()


@pytest.mark.parametrize("additional, env, match", [
    ({"hlserve": {"agin": 1}}, {}, "unknown hlserve option 'agin'"),
    ({}, {"HLSERVE_VLLM_AGIN": "1"}, "unknown hlserve option"),
    ({"hlserve": {"budget_min": 2.5}}, {}, "budget_min"),
    ({"hlserve": {"mixing": "sometimes"}}, {}, "mixing must be one of"),
    ({"hlserve": {"mixing": "prefill_first"}}, {}, "the vLLM plugin runs mixing"),
    ({"hlserve": {"admission": "vllm"}}, {}, "admission must be one of"),
    # 0 and "" are not "no cap" (parse_cap): an error, not a silent default
    ({"hlserve": {"interactive_chunk_size": 0}}, {}, "interactive_chunk_size"),
    ({}, {"HLSERVE_VLLM_BUDGET_MAX": ""}, "budget_max"),
    ({"hlserve": {"ema_alpha": 0}}, {}, "ema_alpha must be in"),
    # checks of the one EngineConfig, which the plugin's options are
    ({"hlserve": {"budget_min": 0}}, {}, "budget_min must be >= 1"),
    ({}, {"HLSERVE_VLLM_BUDGET_WARMUP": "-1"}, "budget_warmup must be >= 0"),
    ({"hlserve": {"lpm_aging": -2}}, {}, "lpm_aging must be >= 0"),
    ({"hlserve": {"two_stage_low": 0.95}}, {}, "two_stage_low < two_stage_high"),
    ({"hlserve": [1]}, {}, "must be an object"),
])
def test_bad_options_are_errors(additional: dict, env: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_options(additional, env)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3", "0.32.1.dev4+gabc", "0.33.0", "0.34.0",
                                     "0.34.2"])
def test_supported_vllm_versions(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.35.0", "1.0.0", "dev"])
def test_other_vllm_versions_fail_with_the_fix(version: str) -> None:
    with pytest.raises(UnsupportedVLLMError,
                       match=r"supports vLLM 0\.32\.x, 0\.33\.x and 0\.34\.x.*found"):
        check_vllm_version(version)


def test_request_class_by_xargs_then_priority_then_default() -> None:
    o = PluginOptions(interactive_priority=-1)
    assert request_class({"request_class": "interactive"}, 0, o) == "interactive"
    assert request_class({"request_class": "agent"}, -5, o) == "agent"
    assert request_class(None, -1, o) == "interactive"
    assert request_class({}, 0, o) == "agent"
    assert request_class(None, -9, PluginOptions()) == "agent"  # no priority rule by default


def test_step_caps_tighten_only_where_an_interactive_request_feels_them() -> None:
    c = plugin_config(PluginOptions(), CAPS)
    assert step_caps(c, 8000.0, NO_INTERACTIVE) == StepCaps(float("inf"), 8000.0)
    assert step_caps(c, 8000.0, INTERACTIVE_WAITING) == StepCaps(512, 8000.0)
    assert step_caps(c, 8000.0, INTERACTIVE_DECODING) == StepCaps(512, 2048)
    # in vLLM's knobs: greedy prefill is threshold 0, the hard cap bounds the budget, and
    # the budget is at least one token per decoding request
    assert vllm_knobs(step_caps(c, 1800.0, NO_INTERACTIVE), 2048, 3) == VLLMKnobs(1800, 0)
    assert vllm_knobs(step_caps(c, 9000.0, NO_INTERACTIVE), 2048, 0).token_budget == 2048
    assert vllm_knobs(step_caps(c, 256.0, NO_INTERACTIVE), 2048, 600).token_budget == 600
    own = plugin_config(PluginOptions(), VLLMCaps("0.32.0", "m", 2048, 256, 8704, 71, 128,
                                                   1024, True, True))
    assert vllm_knobs(step_caps(own, 1800.0, NO_INTERACTIVE), 2048, 0).chunk == 1024


def _policy(**options: object) -> PluginPolicy:
    return PluginPolicy(parse_options({"hlserve": options}, {}), CAPS, NoPrefixCache())


def test_admission_backfills_around_a_request_that_does_not_fit() -> None:
    """hlserve's backpressure: a request whose projected blocks do not fit waits, and those
    behind it that fit are admitted (the old plugin held every request behind it)."""
    p = _policy(mixing="always", order="fcfs")
    running = [vreq("run", 1001, 400, computed=1000, output=1)]
    waiting = [vreq("big", 4000, 4000, arrival=1.0), vreq("small", 200, 16, arrival=2.0)]
    plan = p.plan(waiting, running, 30, 0, 0.5)  # 30 blocks: big needs 32 + 31, small 2
    assert [r.request_id for r in plan.held] == ["big"]
    assert [r.request_id for r in plan.admitted] == ["small"]
    assert [r.request_id for r in plan.queue] == ["small"]


def test_admission_stops_at_the_steps_budget() -> None:
    p = _policy(mixing="always", order="fcfs")
    plan = p.plan([vreq("long", 8000, 600)], [], 71, 0, 0.0)
    assert [r.request_id for r in plan.admitted] == ["long"]  # its first chunk: 2048 tokens
    # the budget: a running prefill takes the whole step, nothing is admitted beside it
    busy = [vreq("pre", 6000, 16, computed=0)]
    plan = p.plan([vreq("next", 100, 16, arrival=1.0)], busy, 60, 0, 0.2)
    assert plan.admitted == [] and [r.request_id for r in plan.held] == ["next"]


def test_two_stage_decode_only_admits_nothing_and_chunk_is_vllms_own() -> None:
    p = _policy(order="fcfs")
    running = [vreq(f"d{i}", 1001, 400, computed=1000, output=1) for i in range(8)]
    waiting = [vreq("w", 3000, 16)]
    plan = p.plan(waiting, running, 2, 2, 0.97)  # KV use past 0.9, pending > evictable
    assert plan.decode_only and plan.admitted == [] and plan.held == []
    plan = _policy(admission="chunk").plan(waiting, running, 2, 2, 0.5)
    assert plan.queue == waiting and plan.held == []  # vLLM's own admission decides


def test_start_up_block_lists_every_cap() -> None:
    text = _policy().describe()
    for name in ("chunk_size", "token_budget", "interactive_chunk_size",
                 "interactive_token_budget", "prefill_delay", "max_num_batched_tokens",
                 "max_num_seqs", "max_model_len", "kv_pool", "mixing=two_stage",
                 "order=lpm", "admission=backpressure"):
        assert name in text, name
    assert "below max_model_len" in text  # the hint to raise --max-num-batched-tokens
