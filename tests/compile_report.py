"""How much of the suite's time is compilation: a pytest plugin (loaded by tests/conftest.py).

1. In each test process, a JAX monitoring listener adds up the three stages of making a program: tracing to
   a jaxpr, lowering to StableHLO, and the backend compile (which includes reading an entry of the run's
   persistent cache: a hit costs that read only).
2. Each test's report carries what its setup, call and teardown spent there (`user_properties`), so under
   pytest-xdist the controller sees the workers' figures.
3. The terminal summary prints the totals, the share of test time they are, and the files that spend most.
   Programs compiled in the tests' own subprocesses (servers started as commands, the 8-device parts,
   notebooks, multi-host) are not seen: their time counts as test time only.
"""

from __future__ import annotations

import collections

import pytest

STAGES = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
_spent: collections.Counter = collections.Counter()  # this process's seconds per stage, since it started
_listening = False


def _on_duration(event: str, duration: float, **_) -> None:
    stage = STAGES.get(event)
    if stage:
        _spent[stage] += duration


def _listen() -> None:
    """Registered when the first test of this process starts (a controller that runs none never imports JAX),
    before its fixtures build anything."""
    global _listening
    if not _listening:
        import jax
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _listening = True


_phase_start = pytest.StashKey[collections.Counter]()


def _mark(item) -> None:
    _listen()
    item.stash[_phase_start] = collections.Counter(_spent)


# Each phase starts its count before any fixture of that phase runs (tryfirst), and ends in its report.
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _mark(item)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    _mark(item)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item):
    _mark(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _listen()
    start = item.stash.get(_phase_start, collections.Counter(_spent))
    spent = {stage: round(_spent[stage] - start[stage], 3) for stage in STAGES.values()}
    outcome.get_result().user_properties.append(("compile_seconds", spent))


class Summary:
    def __init__(self):
        self.test_seconds = collections.Counter()  # per file
        self.stage_seconds = collections.defaultdict(collections.Counter)  # per file, per stage

    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::")[0]
        self.test_seconds[path] += report.duration
        for name, spent in report.user_properties:
            if name == "compile_seconds":
                self.stage_seconds[path].update(spent)

    def pytest_terminal_summary(self, terminalreporter):
        total = sum(self.test_seconds.values())
        if not total:
            return
        stages = sum(self.stage_seconds.values(), collections.Counter())
        compiled = sum(stages.values())
        write = terminalreporter.write_line
        terminalreporter.section("compilation share")
        write(f"test time {total:.0f} s (setup + call + teardown, summed over workers); in this process's JAX: "
              f"trace {stages['trace']:.0f} s, lower {stages['lower']:.0f} s, backend compile or cache read "
              f"{stages['compile']:.0f} s = {compiled:.0f} s ({100 * compiled / total:.0f}%)")
        write("file | test s | compile s (trace + lower + backend)")
        for path, seconds in self.test_seconds.most_common(15):
            write(f"{path} | {seconds:.0f} | {sum(self.stage_seconds[path].values()):.0f}")


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        config.pluginmanager.register(Summary(), "jaxserve-compile-summary")
