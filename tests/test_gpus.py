"""GPU selection (ddip.gpus) as data in, data out, and what Group / ranch make of it; no GPU needed.

The notebook's CUDA_VISIBLE_DEVICES is the universe: numbers are positions in its visible list,
"all" is that list, UUIDs / MIG ids pass through, anything else is an error naming what is
visible. Ranks get the group's entries, in the order given, as their CUDA_VISIBLE_DEVICES.
"""

import os

import pytest

import ddip
from ddip.gpus import GpuInfo, Selected, select, visible_entries
from ddip.kernel.group import resolve_backend
from conftest import children_of
from fake_nvidia_smi import fake_gpus  # noqa: F401  (a fixture)

SLURM = "4,5,6,7"
PHYSICAL = [GpuInfo(i, f"GPU-{i}aaa{i}", "H100", 81559) for i in range(8)]


def entries(sel):
    return [s.entry for s in sel]


def positions(sel):
    return [s.position for s in sel]


def slurm_select(request):
    return select(request, SLURM, PHYSICAL)


def no_processes_started(before):
    return children_of(os.getpid()) == before


# -- visible_entries ------------------------------------------------------------------------------


def test_unset_env_means_every_physical_gpu_by_index():
    assert visible_entries(None, 4) == ["0", "1", "2", "3"]
    assert visible_entries(None, 0) == []


def test_env_lists_the_visible_entries_in_its_order():
    assert visible_entries("4,5,6,7", 8) == ["4", "5", "6", "7"]
    assert visible_entries("3,1", 8) == ["3", "1"]
    assert visible_entries(" 2 , 0 ", 8) == ["2", "0"]  # spaces around entries are ignored


def test_env_can_hide_gpus_but_not_add_any():
    # No GPU here (neither /proc/driver/nvidia nor nvidia-smi lists one): nothing is visible,
    # whatever CUDA_VISIBLE_DEVICES lists.
    assert visible_entries("0,1", 0) == []
    assert visible_entries("GPU-0aaa0", 0) == []
    assert visible_entries("0,1,9", 2) == ["0", "1"]  # and past the GPUs there are, it ends


def test_gpus_the_env_names_on_a_machine_without_any_name_what_is_visible():
    says = ("the notebook sees no GPU: its CUDA_VISIBLE_DEVICES='0,1' names GPUs, but this machine has no "
            "NVIDIA GPU; to run CPU processes instead, use n=2 (for example) for a group, or leave out gpus= "
            "in ranch")
    for request_, first in (([0, 1], "GPU 0 is not visible: "), ("1", "GPU 1 is not visible: "),
                            ("all", "'all' GPUs, but ")):
        with pytest.raises(ValueError) as err:
            select(request_, "0,1", [])
        assert str(err.value) == first + says


@pytest.mark.parametrize("env", ["", "-1", " ", "-1,0,1", ",0"])
def test_empty_or_negative_first_entry_hides_every_gpu(env):
    assert visible_entries(env, 8) == []


@pytest.mark.parametrize("env, visible", [("0,1,-1,2", ["0", "1"]), ("0,,1", ["0"]), ("3,-5", ["3"])])
def test_the_list_ends_at_the_first_empty_or_negative_entry(env, visible):
    # CUDA's rule: devices after the first invalid entry are not visible.
    assert visible_entries(env, 8) == visible


@pytest.mark.parametrize("env, visible", [("0,junk,1", ["0"]), ("0,9,1", ["0"])])
def test_the_list_ends_at_the_first_invalid_entry_like_cuda(env, visible):
    assert visible_entries(env, 2) == visible


def test_uuid_and_mig_entries_are_kept_as_given():
    env = "GPU-5aaa5,MIG-1234-abcd,GPU-2aaa2"
    assert visible_entries(env, 8) == ["GPU-5aaa5", "MIG-1234-abcd", "GPU-2aaa2"]


# -- select: positions ----------------------------------------------------------------------------


def test_all_without_restriction_is_every_physical_gpu_in_order():
    sel = select("all", None, PHYSICAL[:4])
    assert sel == [Selected("0", 0), Selected("1", 1), Selected("2", 2), Selected("3", 3)]


@pytest.mark.parametrize("request_", ["all", "ALL", " all "])
def test_all_under_slurm_is_the_visible_four_in_order(request_):
    sel = slurm_select(request_)
    assert entries(sel) == ["4", "5", "6", "7"] and positions(sel) == [0, 1, 2, 3]


@pytest.mark.parametrize("request_", ["0,1,2,3", [0, 1, 2, 3], (0, 1, 2, 3), range(4), ["0", "1", "2", "3"],
                                      "0, 1 ,2,3"])
def test_positions_under_slurm_map_to_the_visible_entries(request_):
    sel = slurm_select(request_)
    assert entries(sel) == ["4", "5", "6", "7"] and positions(sel) == [0, 1, 2, 3]


def test_a_single_position_as_int_or_string():
    assert slurm_select(2) == [Selected("6", 2)]
    assert slurm_select("3") == [Selected("7", 3)]


@pytest.mark.parametrize("request_", ["1,0", [1, 0]])
def test_order_given_is_kept(request_):
    assert slurm_select(request_) == [Selected("5", 1), Selected("4", 0)]
    assert select(request_, None, PHYSICAL[:2]) == [Selected("1", 1), Selected("0", 0)]


def test_any_order_and_subset():
    assert entries(slurm_select([3, 0, 2])) == ["7", "4", "6"]
    assert positions(slurm_select([3, 0, 2])) == [3, 0, 2]


@pytest.mark.parametrize("request_", [4, "4", [0, 4], "7", -1, "-1"])
def test_a_position_outside_the_visible_list_names_what_is_visible(request_):
    with pytest.raises(ValueError) as err:
        slurm_select(request_)
    msg = str(err.value)
    assert "is not visible" in msg
    assert "CUDA_VISIBLE_DEVICES=4,5,6,7" in msg  # what the notebook sees
    assert "sees 4 GPUs" in msg and "positions 0-3" in msg  # what to give instead
    assert "'all'" in msg and "UUID" in msg


def test_out_of_range_without_restriction_says_how_many_there_are():
    with pytest.raises(ValueError, match=r"GPU 2 is not visible: the notebook sees 2 GPUs: give positions 0-1"):
        select([0, 2], None, PHYSICAL[:2])


def test_one_visible_gpu_is_described_in_the_singular():
    with pytest.raises(ValueError, match=r"sees 1 GPU \(CUDA_VISIBLE_DEVICES=5\): give positions 0,"):
        select(1, "5", PHYSICAL)


@pytest.mark.parametrize("request_, dup", [("0,0", "4"), ([1, 2, 1], "5"), ("3,2,3,2", "6, 7")])
def test_duplicates_are_an_error_naming_the_gpu(request_, dup):
    with pytest.raises(ValueError, match=f"list GPU {dup} more than once; each rank needs its own GPU"):
        slurm_select(request_)


def test_a_position_and_a_visible_uuid_naming_the_same_gpu_are_duplicates():
    visible = ["GPU-5aaa5", "GPU-2aaa2"]
    with pytest.raises(ValueError, match="more than once"):
        select([0, "GPU-5aaa5"], ",".join(visible), PHYSICAL)


def test_a_position_and_a_physical_uuid_naming_the_same_gpu_are_duplicates():
    with pytest.raises(ValueError, match="more than once"):
        select([0, "GPU-0aaa0"], None, PHYSICAL[:2])


@pytest.mark.parametrize("request_", ["", [], (), " , ", ","])
def test_an_empty_request_is_a_clear_error(request_):
    with pytest.raises(ValueError, match="gpus is empty; give 'all', positions like '0,3', or GPU UUIDs"):
        slurm_select(request_)


@pytest.mark.parametrize("request_", ["zero", "0,one", "cuda:0", None, True, False, [True], [0, False], 1.0,
                                      object(), [None], ["all"], "gpu-0aaa0"])
def test_junk_is_not_a_gpu_list(request_):
    # Python's forms are checked here, the words in a string by the launch plan: both say how.
    with pytest.raises(ValueError, match=r"is not a GPU( list)?; give 'all', positions like '?0,3'?"):
        slurm_select(request_)


def test_empty_items_between_commas_are_skipped():
    assert entries(slurm_select("0,,1")) == ["4", "5"]


def test_a_fractional_position_is_not_a_gpu():
    with pytest.raises(ValueError):
        slurm_select([1.5])


# -- select: UUIDs and MIG ids ------------------------------------------------------------------


def test_visible_uuids_are_selected_by_uuid_or_position():
    env = "GPU-5aaa5,GPU-2aaa2"
    visible = visible_entries(env, 8)
    assert select("GPU-2aaa2", env, PHYSICAL) == [Selected("GPU-2aaa2", 1)]
    assert select([1, 0], env, PHYSICAL) == [Selected("GPU-2aaa2", 1), Selected("GPU-5aaa5", 0)]
    assert select("all", env, PHYSICAL) == [Selected("GPU-5aaa5", 0), Selected("GPU-2aaa2", 1)]


def test_visible_mig_ids_are_selected_by_id_or_position():
    env = "MIG-aaaa-1111,MIG-bbbb-2222"
    visible = visible_entries(env, 1)
    assert select("MIG-bbbb-2222", env, PHYSICAL[:1]) == [Selected("MIG-bbbb-2222", 1)]
    assert select(0, env, PHYSICAL[:1]) == [Selected("MIG-aaaa-1111", 0)]


@pytest.mark.parametrize("uid", ["GPU-3aaa3", "MIG-cccc-3333", "GPU-nonexistent"])
def test_an_id_outside_a_restricted_list_names_what_is_visible(uid):
    with pytest.raises(ValueError) as err:
        slurm_select(uid)
    msg = str(err.value)
    assert msg.startswith(f"{uid} is not visible: ")
    assert "CUDA_VISIBLE_DEVICES=4,5,6,7" in msg and "positions 0-3" in msg


def test_an_id_when_the_notebook_sees_no_gpu():
    with pytest.raises(ValueError, match=r"GPU-1aaa1 is not visible: the notebook sees no GPU "
                                         r"\(CUDA_VISIBLE_DEVICES=''\)"):
        select("GPU-1aaa1", "", PHYSICAL)


def test_uuids_without_restriction_are_matched_against_the_physical_gpus():
    visible = visible_entries(None, 4)
    sel = select("GPU-3aaa3,GPU-1aaa1", None, PHYSICAL[:4])
    assert sel == [Selected("GPU-3aaa3", 3), Selected("GPU-1aaa1", 1)]  # entry as given, position = index
    assert select(["GPU-2aaa2", 0], None, PHYSICAL[:4]) == [Selected("GPU-2aaa2", 2), Selected("0", 0)]


def test_an_unknown_uuid_without_restriction_lists_the_machines_uuids():
    with pytest.raises(ValueError, match="no GPU has UUID GPU-ffff; this machine has GPU-0aaa0, GPU-1aaa1"):
        select("GPU-ffff", None, PHYSICAL[:2])


def test_a_mig_id_without_restriction_passes_through_with_no_position():
    # MIG ids are not matched against nvidia-smi's GPU UUIDs: CUDA resolves them in the rank.
    assert select("MIG-aaaa-1111", None, PHYSICAL[:2]) == [Selected("MIG-aaaa-1111", None)]


def test_ids_pass_through_when_the_physical_uuids_are_unknown():
    # No nvidia-smi (GPUs found through /proc only): nothing to check a UUID against.
    no_uuids = [GpuInfo(0), GpuInfo(1)]
    visible = visible_entries(None, 2)
    assert select("GPU-0aaa0", None, no_uuids) == [Selected("GPU-0aaa0", None)]



# -- nothing visible ----------------------------------------------------------------------------


@pytest.mark.parametrize("env", ["", "-1"])
def test_all_when_the_env_hides_every_gpu(env):
    with pytest.raises(ValueError) as err:
        select("all", env, PHYSICAL)
    msg = str(err.value)
    assert f"the notebook sees no GPU (CUDA_VISIBLE_DEVICES={env!r})" in msg
    assert "to run CPU processes instead, use n=2 (for example) for a group, or leave out gpus= in ranch" in msg


def test_all_on_a_machine_without_gpus():
    with pytest.raises(ValueError, match="'all' GPUs, but this machine has no NVIDIA GPU; to run CPU processes instead, use n=2"):
        select("all", None, [])


def test_a_position_on_a_machine_without_gpus():
    with pytest.raises(ValueError, match="GPU 0 is not visible: this machine has no NVIDIA GPU; to run CPU processes instead, use n=2"):
        select([0], None, [])


# -- backend ------------------------------------------------------------------------------------


def test_nccl_for_gpu_groups_gloo_for_cpu_ones():
    assert resolve_backend("auto", ["4", "5"]) == "nccl"
    assert resolve_backend("auto", None) == "gloo"
    assert resolve_backend(None, ["0"]) is None
    with pytest.raises(ValueError, match="backend='nccl' needs GPUs"):
        resolve_backend("nccl", None)


# -- Group: the visible list positions refer to, and what ranks get -------------------------------


@pytest.mark.parametrize("env, gpus, says", [
    ("", [0], "GPU 0 is not visible: the group's env= sees no GPU (CUDA_VISIBLE_DEVICES='')"),
    ("-1", "all", "'all' GPUs, but the group's env= sees no GPU (CUDA_VISIBLE_DEVICES='-1')"),
    ("4,5", [2], "GPU 2 is not visible: the group's env= sees 2 GPUs (CUDA_VISIBLE_DEVICES=4,5): give positions 0-1"),
])
def test_group_with_nothing_visible_in_its_env_fails_before_starting(env, gpus, says, fake_gpus):
    fake_gpus(8)
    before = children_of(os.getpid())
    with pytest.raises(ValueError) as err:
        ddip.Group(gpus=gpus, env={"CUDA_VISIBLE_DEVICES": env})
    assert says in str(err.value)
    assert no_processes_started(before)


def test_group_positions_refer_to_the_env_given_and_ranks_get_the_entries_in_order(monkeypatch, fake_gpus):
    fake_gpus(8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # the kernel's own list, overridden by env=
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    # backend=None: nothing in the ranks touches CUDA, so this runs without a GPU.
    with ddip.Group(gpus=[1, 0], backend=None, env={"CUDA_VISIBLE_DEVICES": "4,5"}) as g:
        assert g.gpus == ["5", "4"] and g.size == 2 and g.backend is None
        assert [g.device(r) for r in range(2)] == ["cuda:0 (GPU 5)", "cuda:1 (GPU 4)"]
        got = g.apply(lambda: tuple(__import__("os").environ.get(k) for k in
                                    ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "CUDA_DEVICE_ORDER")))
        assert got == [("5,4", "0", "PCI_BUS_ID"), ("5,4", "1", "PCI_BUS_ID")]


def test_group_positions_refer_to_the_notebooks_env(monkeypatch, fake_gpus):
    fake_gpus(8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", SLURM)
    with ddip.Group(gpus="3,1", backend=None) as g:
        assert g.gpus == ["7", "5"]
        assert g.apply(lambda: __import__("os").environ["CUDA_VISIBLE_DEVICES"]) == ["7,5", "7,5"]


def test_cpu_group_passes_the_users_cuda_visible_devices_through():
    with ddip.Group(n=1, backend=None, env={"CUDA_VISIBLE_DEVICES": "3"}) as g:
        assert g.apply(lambda: __import__("os").environ["CUDA_VISIBLE_DEVICES"]) == ["3"]


def test_cpu_group_ranks_see_no_gpu_by_default(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # even when the notebook sees some
    with ddip.Group(n=1, backend=None) as g:
        assert g.apply(lambda: __import__("os").environ["CUDA_VISIBLE_DEVICES"]) == [""]


# -- ranch ----------------------------------------------------------------------------------------


def _env_of_rank():
    import os

    return os.environ.get("RANK"), os.environ.get("LOCAL_RANK"), os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.mark.skipif(bool(ddip.gpus.physical_gpus()), reason="needs a machine without NVIDIA GPUs")
def test_ranch_with_gpus_on_a_machine_without_gpus_fails_before_starting(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    before = children_of(os.getpid())
    with pytest.raises(ValueError, match="GPU 0 is not visible: this machine has no NVIDIA GPU"):
        ddip.ranch(2, _env_of_rank, gpus=[0, 1])
    with pytest.raises(ValueError, match="this machine has no NVIDIA GPU"):
        ddip.torchddp_launch(2, _env_of_rank, gpus=[0, 1])
    with pytest.raises(ValueError, match="'all' GPUs, but this machine has no NVIDIA GPU"):
        ddip.ranch(2, _env_of_rank, ctx=ddip.TorchDDPCtx(gpus="all"))
    assert no_processes_started(before)


def test_ranch_with_gpus_hidden_by_the_notebooks_env_fails_before_starting(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    before = children_of(os.getpid())
    with pytest.raises(ValueError, match=r"GPU 0 is not visible: the notebook sees no GPU \(CUDA_VISIBLE_DEVICES=''\)"):
        ddip.ranch(2, _env_of_rank, gpus=[0, 1])
    assert no_processes_started(before)


def test_ranch_gpu_count_must_match_nprocs(monkeypatch, fake_gpus):
    fake_gpus(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    before = children_of(os.getpid())
    with pytest.raises(ValueError, match=r"2 GPUs \(0, 1\) for 3 ranks: give one GPU per rank"):
        ddip.ranch(3, _env_of_rank, gpus=[0, 1])
    with pytest.raises(ValueError, match=r"1 GPUs \(1\) for 2 ranks: give one GPU per rank"):
        ddip.ranch(2, _env_of_rank, gpus="1")
    with pytest.raises(ValueError, match=r"2 GPUs \(0, 1\) for 3 ranks"):
        ddip.torchddp_launch(3, _env_of_rank, gpus="all")
    with pytest.raises(ValueError, match=r"2 GPUs \(1, 0\) for 1 ranks"):
        ddip.ranch(1, _env_of_rank, ctx=ddip.TorchDDPCtx(gpus=[1, 0]))
    with pytest.raises(ValueError, match=r"gpus=\[0, 1\] and the ctx's gpus=\['1', '0'\] differ; give the GPUs once"):
        ddip.ranch(2, _env_of_rank, gpus=[0, 1], ctx=ddip.TorchDDPCtx(gpus=[1, 0]))
    with pytest.raises(ValueError, match="GPU 2 is not visible"):
        ddip.ranch(2, _env_of_rank, gpus=[0, 2])
    assert no_processes_started(before)


def test_torchddp_ctx_resolves_positions_against_the_notebooks_env(monkeypatch, fake_gpus):
    fake_gpus(8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", SLURM)
    ctx = ddip.TorchDDPCtx(gpus=[2, 0])
    assert ctx.gpus == ["6", "4"] and ctx.selected == [Selected("6", 2), Selected("4", 0)]
    assert ctx.backend == "nccl"
    assert ddip.TorchDDPCtx().backend == "gloo" and ddip.TorchDDPCtx().gpus is None
    with pytest.raises(ValueError, match="backend='nccl' needs GPUs"):
        ddip.TorchDDPCtx(backend="nccl")


def test_ranch_children_get_their_gpus_in_their_env_in_the_order_given(monkeypatch, fake_gpus):
    # No ctx: nothing touches CUDA, so the children's environment can be checked with GPUs that
    # only nvidia-smi's stand-in lists.
    fake_gpus(8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", SLURM)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    # The notebook as rank 0 keeps its own view (it selects its GPU by position instead).
    assert ddip.ranch(2, _env_of_rank, gpus=[3, 1]) == [("0", "0", SLURM), ("1", "1", "7,5")]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == SLURM  # the notebook's env is restored
    got = ddip.ranch(2, _env_of_rank, gpus="2,0", caller_rank=None)
    assert got == [("0", "0", "6,4"), ("1", "1", "6,4")]


def test_ranch_without_gpus_keeps_children_off_the_gpus(monkeypatch, fake_gpus):
    fake_gpus(8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", SLURM)
    assert ddip.ranch(2, _env_of_rank, caller_rank=None) == [("0", "0", ""), ("1", "1", "")]


def test_the_machines_gpus_are_asked_once_per_ttl(monkeypatch):
    # One %makedip -g asks several times (count, selection, status); nvidia-smi takes 0.1-1 s.
    calls = []
    rows = [["1", "GPU-b", "H100", "81559"], ["0", "GPU-a", "H100", "81559"]]
    monkeypatch.setattr(ddip.gpus, "_smi", lambda *args, **kw: calls.append(args) or rows)
    monkeypatch.setattr(ddip.gpus, "_inventory_cache", None)
    clock = [1000.0]
    monkeypatch.setattr(ddip.gpus.time, "monotonic", lambda: clock[0])
    first = ddip.gpus.physical_gpus()
    assert [g.uuid for g in first] == ["GPU-a", "GPU-b"]  # in index order
    first.clear()  # callers get their own list
    assert [g.index for g in ddip.gpus.physical_gpus()] == [0, 1]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert ddip.gpus.inventory()[0] == ["0", "1"]
    assert len(calls) == 1
    clock[0] += ddip.gpus.INVENTORY_TTL_S
    ddip.gpus.physical_gpus()
    assert len(calls) == 2  # a stale answer is asked again
