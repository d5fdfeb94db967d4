"""Test hooks (launcher/components/hooks.py) are read once, at start, into one object; nothing else reads the
ZEROTRAIN_TEST_* variables (in particular nothing in the step loop). The end-to-end tests that set them
(test_long_runs, test_checkpointer's 2-rank harness, test_preflight) show that they still reach real ranks."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from zerotrain.launcher.components.hooks import NO_HOOKS, TestHooks
from zerotrain.launcher.errors import UsageError

REPO = Path(__file__).resolve().parent.parent


def test_no_variable_set_is_the_no_op_object():
    hooks = TestHooks.from_env({"PATH": "/bin", "ZEROTRAIN_EXIT_FILE": "x"})
    assert hooks is NO_HOOKS
    assert hooks.spike_factor(0, 5) == 1.0 and not hooks.fails_save(0, 5) and hooks.slow_save_s == 0.0


def test_values_are_parsed_once_into_the_object():
    hooks = TestHooks.from_env({"ZEROTRAIN_TEST_SPIKE": "1:32-34:20", "ZEROTRAIN_TEST_FAIL_SAVE": "1:40,0:3",
                                "ZEROTRAIN_TEST_SLOW_SAVE": "0.3", "ZEROTRAIN_TEST_PREFLIGHT_READBACK": "perturb",
                                "ZEROTRAIN_TEST_SLOW_LOADER": "0.5", "ZEROTRAIN_TEST_PREFLIGHT_OOM": "1:4"})
    assert [hooks.spike_factor(r, s) for r, s in ((1, 31), (1, 32), (1, 34), (0, 33), (1, 35))] == [1, 20, 20, 1, 1]
    assert hooks.fails_save(1, 40) and hooks.fails_save(0, 3) and not hooks.fails_save(0, 40)
    assert (hooks.slow_save_s, hooks.preflight_readback, hooks.slow_loader_s) == (0.3, "perturb", 0.5)
    assert hooks.preflight_oom == (1, 4)


@pytest.mark.parametrize("name, value", [("ZEROTRAIN_TEST_SPIKE", "1:32:20"), ("ZEROTRAIN_TEST_FAIL_SAVE", "1"),
                                         ("ZEROTRAIN_TEST_SLOW_MIRROR", "soon"), ("ZEROTRAIN_TEST_PREFLIGHT_OOM", "1")])
def test_a_malformed_value_is_one_line_naming_the_variable(name, value):
    with pytest.raises(UsageError, match=rf"^{name}={value}: expected"):
        TestHooks.from_env({name: value})


def test_every_test_variable_set_is_said_known_or_not():
    assert TestHooks.from_env({"PATH": "/bin"}).describe() is None
    hooks = TestHooks.from_env({"ZEROTRAIN_TEST_SLOW_SAVE": "0.3", "ZEROTRAIN_TEST_SLOW_MARKER": "2"})
    assert hooks.variables == (("ZEROTRAIN_TEST_SLOW_MARKER", "2"), ("ZEROTRAIN_TEST_SLOW_SAVE", "0.3"))
    assert hooks.describe().startswith("zerotrain: warning: test hooks active: ZEROTRAIN_TEST_SLOW_MARKER=2 (not a"
                                       " hook: ignored), ZEROTRAIN_TEST_SLOW_SAVE=0.3 (faults and delays")


def test_only_the_hooks_module_reads_the_variables():
    reads = re.compile(r"(environ|getenv)\W[^\n]*ZEROTRAIN_TEST|ZEROTRAIN_TEST_\w+[\"']\s*(in|\])")
    found = [f"{p.relative_to(REPO)}:{i}" for folder in ("launcher", "dataio", "modeling", "zerotrain")
             for p in (REPO / folder).rglob("*.py") if p.name != "hooks.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if reads.search(line)]
    assert not found, f"ZEROTRAIN_TEST_* read outside launcher/components/hooks.py: {found}"


def test_the_preflight_oom_loader_raises_on_its_second_batch_on_that_rank_and_micro_batch_only():
    import torch

    class Loader:
        def next(self):
            return "batch"

    hooks = TestHooks.from_env({"ZEROTRAIN_TEST_PREFLIGHT_OOM": "1:4"})
    loader = Loader()
    assert hooks.preflight_loader(loader, 0, 4) is loader and hooks.preflight_loader(loader, 1, 2) is loader
    planted = hooks.preflight_loader(loader, 1, 4)
    assert planted.next() == "batch"
    with pytest.raises(torch.OutOfMemoryError):
        planted.next()


def test_the_production_run_gets_the_plain_pieces_and_a_hook_its_stand_in(tmp_path):
    """No ZEROTRAIN_TEST_* variable: the run's clock is a plain PhaseClock (no test branch in the production
    step); a hang or a rank death planted: the FaultyClock that plants it."""
    from zerotrain.launcher.components import faults
    from zerotrain.launcher.components.observe.phases import PhaseClock

    assert type(faults.clock(TestHooks.from_env({}), 0, tmp_path, lambda: 1)) is PhaseClock
    for env in ({"ZEROTRAIN_TEST_HANG": "1:save:3"}, {"ZEROTRAIN_TEST_DIE_AFTER_END": "1"}):
        assert isinstance(faults.clock(TestHooks.from_env(env), 0, tmp_path, lambda: 1), faults.FaultyClock)
