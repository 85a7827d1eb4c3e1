"""The warm rank template (ddip.template): ranks forked from it are indistinguishable from cold
ones, die with the kernel, and ddip falls back to cold ranks, saying why, when it can't be used."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import ddip
import ddip.template as template
from conftest import PY, alive, wait_until

torch = pytest.importorskip("torch")

PROBE = ("import ddip.template, os, sys, random, numpy, torch\n"
         "(ddip.template.forked, os.getpid(), os.getppid(), os.getpgid(0), random.random(),\n"
         " float(numpy.random.rand()), torch.rand(1).item(), os.getcwd(), sys.argv)")


@pytest.fixture(autouse=True)
def ready_template():
    """Each test starts with the default template ready, and leaves one for the next."""
    template.prewarm()
    template._handle.wait_ready(120_000)
    yield
    if template._handle.status()[0] != "ready" or template._modules != template.DEFAULT_MODULES:
        template.prewarm()


def test_an_idle_template_sleeps(tmp_path):
    # It waits for fork requests in C++, in slices of a second (a signal ends the wait itself, so
    # its Python handlers run at once), not 20 times a second.
    pid = template._handle.status()[1]

    def sleeps():
        with open(f"/proc/{pid}/task/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches:"))

    before = sleeps()
    time.sleep(2)  # the idle time measured
    woke = sleeps() - before
    assert woke <= 6, f"the idle template woke {woke} times in 2 s"
    with ddip.Group(n=1, backend=None) as g:  # and it still forks at once
        assert g.run("import ddip.template as t; t.forked")[0].value is True


def test_forked_ranks_are_the_kernels_children_with_their_own_state(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the notebook's *current* directory, changed after the template started
    with ddip.Group(n=2, backend="gloo") as g:
        rows = [r.value for r in g.run(PROBE)]
        pids = g.pids
    for (forked, pid, ppid, pgid, *_r, cwd, argv), expected in zip(rows, pids):
        assert forked, "the rank was not forked from the template"
        assert pid == expected and ppid == os.getpid() and pgid == pid
        assert cwd == str(tmp_path) and argv == ["-c"]
    for column in (4, 5, 6):  # random, numpy, torch: distinct per rank
        assert rows[0][column] != rows[1][column]
    assert len({pids[0], pids[1], template._handle.status()[1]}) == 3


def test_forked_ranks_get_their_own_environment(monkeypatch):
    monkeypatch.setenv("DDIP_SET_AFTER_TEMPLATE", "yes")
    with ddip.Group(n=2, backend="gloo", env={"OMP_NUM_THREADS": "1"}) as g:
        res = g.run("import os, torch, ddip.template\n"
                    "e = os.environ\n"
                    "(ddip.template.forked, e['RANK'], e['LOCAL_RANK'], e['WORLD_SIZE'], e['MASTER_PORT'],\n"
                    " e['OMP_NUM_THREADS'], torch.get_num_threads(), e['CUDA_VISIBLE_DEVICES'],\n"
                    " e.get('DDIP_SET_AFTER_TEMPLATE'), 'DDIP_TEMPLATE_SOCKET' in e)")
        port = str(g.master_port)
    assert [r.value for r in res] == [
        (True, str(rank), str(rank), "2", port, "1", 1, "", "yes", False) for rank in (0, 1)]


def test_a_module_written_after_the_template_started_imports_in_a_rank(tmp_path, monkeypatch):
    (tmp_path / "written_late_mod.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with ddip.Group(n=1, backend=None) as g:
        assert g.run("import ddip.template, written_late_mod\n"
                     "(ddip.template.forked, written_late_mod.VALUE)")[0].value == (True, 42)


def test_warm_false_gives_cold_ranks():
    with ddip.Group(n=1, backend=None, warm=False) as g:
        assert g.run("import ddip.template; ddip.template.forked")[0].value is False

    def child_was_forked():
        import ddip.template
        return ddip.template.forked

    assert ddip.ranch(2, child_was_forked, warm=False) == [False, False]
    assert ddip.ranch(2, child_was_forked) == [False, True]  # rank 0 is the notebook itself


def test_a_group_without_torch_does_not_wait_for_the_template_importing_it(tmp_path):
    # The template imports a module that blocks until the test lets it go: a group that won't use
    # it (no backend, no torch in the notebook) starts cold at once; one that asks waits.
    gate = tmp_path / "gate"
    (tmp_path / "slow_to_import.py").write_text(textwrap.dedent(f"""
        import os, time
        while not os.path.exists({str(gate)!r}):
            time.sleep(0.01)
    """))
    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent(f"""
        import pathlib, sys
        sys.path.insert(0, {str(tmp_path)!r})
        import ddip, ddip.template
        ddip.prewarm(modules=("slow_to_import",))
        with ddip.Group(n=2, backend=None) as g:
            forked = [r.value for r in g.run("import ddip.template; ddip.template.forked")]
            print("cold", forked, ddip.template._handle.status()[0], "torch" in sys.modules, flush=True)
        pathlib.Path({str(gate)!r}).touch()
        with ddip.Group(n=1, backend=None, warm=True) as g:
            print("warm", g.run("import ddip.template; ddip.template.forked")[0].value, flush=True)
    """))
    p = subprocess.run([PY, str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["cold [False, False] starting False", "warm True"], p.stdout + p.stderr


def test_prewarm_off_by_environment(monkeypatch, capfd):
    monkeypatch.setenv("DDIP_PREWARM", "0")
    assert "off (DDIP_PREWARM=0)" in template.status()
    with ddip.Group(n=1, backend=None) as g:
        assert g.run("import ddip.template; ddip.template.forked")[0].value is False
    assert "ddip:" not in capfd.readouterr().err  # the user's choice: nothing to explain


def test_a_notebook_function_runs_in_a_warm_ranch_with_gloo():
    ns = {"__name__": "__main__"}  # defined as a notebook cell defines it: pickled by value
    exec(textwrap.dedent("""
        def all_reduce_rank(scale):
            import os, torch, torch.distributed as dist, ddip.template
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            return (ddip.template.forked or os.environ.get("DDIP_SLOT") is None, t.item() * scale)
    """), ns)
    fn = ns["all_reduce_rank"]
    assert fn.__module__ == "__main__"
    assert ddip.ranch(2, fn, 10, ctx=ddip.TorchDDPCtx()) == [(True, 30.0), (True, 30.0)]


def test_ranks_die_with_the_kernel(tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(textwrap.dedent("""
        import ddip, ddip.template, time
        ddip.prewarm()
        g = ddip.Group(n=2, backend=None, warm=True)  # warm=True: waits for the template
        forked = g.run("import ddip.template; ddip.template.forked")
        print(*g.pids, ddip.template._handle.status()[1], all(r.value for r in forked), flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([PY, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        *pids, forked = proc.stdout.readline().split()
        pids = [int(p) for p in pids]
        assert forked == "True" and len(pids) == 3 and all(alive(p) for p in pids)
        proc.kill()  # the kernel dies without closing anything
        proc.wait()
        assert wait_until(lambda: not any(alive(p) for p in pids), 10), "ranks or template outlived the kernel"
    finally:
        proc.kill()
        proc.wait()


def test_a_template_killed_between_groups_is_replaced_with_a_message(capfd):
    with ddip.Group(n=1, backend=None) as g:
        assert g.run("import ddip.template; ddip.template.forked")[0].value is True
    old = template._handle.status()[1]
    os.kill(old, signal.SIGKILL)
    assert wait_until(lambda: template._handle.status()[0] == "dead")
    capfd.readouterr()
    template._said.clear()
    with ddip.Group(n=1, backend=None) as g:
        assert g.run("import ddip.template; ddip.template.forked")[0].value is True
    err = capfd.readouterr().err
    assert "the rank template had stopped" in err and "killed by SIGKILL" in err and "started a new one" in err
    assert template._handle.status()[1] != old


def test_a_module_that_initializes_cuda_on_import_is_left_out(capfd):
    template._said.clear()
    template.prewarm(modules=("torch", "_ddip_cuda_on_import"))
    with ddip.Group(n=1, backend=None) as g:
        # The template left it out, and is still used; the rank imports the module itself.
        assert g.run("import ddip.template, sys, _ddip_cuda_on_import\n"
                     "ddip.template.forked")[0].value is True
    assert "_ddip_cuda_on_import initializes CUDA on import, so the rank template leaves it out" in \
        capfd.readouterr().err
    assert "_ddip_cuda_on_import left out" in template.status()
    template._excluded.clear()


def test_a_template_whose_cuda_got_initialized_is_never_forked(capfd):
    template._said.clear()
    template.prewarm(modules=("torch", "_ddip_cuda_after_ready"))
    assert template._handle.wait_ready(120_000)[0] == "ready"
    with ddip.Group(n=2, backend=None) as g:
        assert [r.value for r in g.run("import ddip.template; ddip.template.forked")] == [False, False]
    err = capfd.readouterr().err
    assert ("some ranks started cold: the rank template refused to fork: "
            "CUDA is initialized in the rank template; it was discarded") in err
    assert template._handle.status()[0] == "dead"
    assert "CUDA was found initialized" in template.status()
    with ddip.Group(n=1, backend=None) as g:  # not tried again until ddip.prewarm()
        assert g.run("import ddip.template; ddip.template.forked")[0].value is False
    template.prewarm()
    with ddip.Group(n=1, backend=None) as g:
        assert g.run("import ddip.template; ddip.template.forked")[0].value is True


def test_status_is_one_line():
    line = template.status()
    assert line.startswith("rank template: ready") and "\n" not in line


def test_building_a_rank_shell_and_its_first_cell_import_and_compile_nothing_the_template_has_not():
    """The template imports what building a rank's IPython shell and running its first cell would
    (SHELL_MODULES), and compiles the tokenizer's patterns (_warm_shell_caches), so a forked rank
    doesn't pay for them; a new IPython that needs more there shows up here."""
    code = textwrap.dedent("""
        import importlib, sys, tokenize
        import ddip.rank.template as t
        for name in t.BASE_MODULES + t.SHELL_MODULES:
            importlib.import_module(name)
        t._warm_shell_caches()
        before, misses = set(sys.modules), tokenize._compile.cache_info().misses
        from ddip.rank import worker
        worker._make_shell().run_cell("x = 1", store_history=True)
        print(sorted(set(sys.modules) - before), tokenize._compile.cache_info().misses - misses)
    """)
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] 0"


def test_a_forked_rank_has_the_ipython_modules_a_cold_rank_has():
    probe = ("import sys, ddip.template\n"
             "(ddip.template.forked, sorted(m for m in sys.modules if m.split('.')[0] == 'IPython'))")
    with ddip.Group(n=1, backend=None) as g:
        forked, warm_modules = g.run(probe)[0].value
    with ddip.Group(n=1, backend=None, warm=False) as g:
        cold, cold_modules = g.run(probe)[0].value
    assert forked and not cold
    assert warm_modules == cold_modules
    assert set(template.SHELL_MODULES) <= set(cold_modules)  # each one is the shell's own import
