"""Golden tests of the container plan's pure pieces (C3, C4, C5, GPU arguments).

AMD, Hygon, Ascend and Moore Threads arguments are checked here only: not verified on
their hardware (docs/operations.md says so).
"""

from __future__ import annotations

import pytest

from heteroflow.core.containers import (
    DEFAULT_ENV_ALLOW,
    ContainerPlan,
    GpuRequest,
    container_env,
    env_allowed,
    env_denied,
    env_problem,
    gpu_request,
    model_mount,
    shared_memory,
)


@pytest.mark.feature("C1")
@pytest.mark.parametrize(
    ("vendor", "ids", "expected"),
    [
        ("nvidia", [1, 3], GpuRequest("nvidia", device_ids=("1", "3"))),
        (
            "amd",
            [0, 1],
            GpuRequest(
                "amd",
                devices=("/dev/kfd", "/dev/dri"),
                group_add=("video", "render"),
                env={"HIP_VISIBLE_DEVICES": "0,1"},
            ),
        ),
        (
            "hygon",
            [2],
            GpuRequest(
                "hygon",
                devices=("/dev/kfd", "/dev/dri"),
                group_add=("video", "render"),
                env={"HIP_VISIBLE_DEVICES": "2"},
            ),
        ),
        (
            "ascend",
            [0, 5],
            GpuRequest(
                "ascend",
                devices=(
                    "/dev/davinci0",
                    "/dev/davinci5",
                    "/dev/davinci_manager",
                    "/dev/devmm_svm",
                    "/dev/hisi_hdc",
                ),
                env={"ASCEND_VISIBLE_DEVICES": "0,5"},
            ),
        ),
        ("musa", [1], GpuRequest("musa", env={"MTHREADS_VISIBLE_DEVICES": "1"})),
    ],
)
def test_gpu_arguments_per_vendor(vendor: str, ids: list[int], expected: GpuRequest) -> None:
    assert gpu_request(vendor, ids) == expected


def test_no_cards_no_gpu_arguments_and_unknown_vendor_refused() -> None:
    assert gpu_request("nvidia", []) is None
    with pytest.raises(ValueError, match="cambricon"):
        gpu_request("cambricon", [0])


@pytest.mark.feature("C3")
def test_env_rules() -> None:
    env = container_env(
        [
            "BARE",
            "KEEP=1",
            "CUDA_VISIBLE_DEVICES=9",
            "HETEROFLOW_TASK_ID=spoof",
            "=x",
            "VLLM_SERVER_DEV_MODE=1",
        ],
        task_id="task-1",
        group_id="tg-1",
        task_name="n-0",
        engine="sglang",
        engine_env={"VLLM_SERVER_DEV_MODE": "1", "SGL_X": "y"},
        gpu=gpu_request("amd", [0]),
    )
    assert env == {
        "KEEP": "1",
        "SGL_X": "y",
        "HIP_VISIBLE_DEVICES": "0",
        "HETEROFLOW_TASK_ID": "task-1",
        "HETEROFLOW_GROUP_ID": "tg-1",
        "HETEROFLOW_TASK_NAME": "n-0",
    }
    vllm = container_env(
        [],
        task_id="t",
        group_id="g",
        task_name="n",
        engine="vllm",
        engine_env={"VLLM_SERVER_DEV_MODE": "1"},
        gpu=None,
    )
    assert vllm["VLLM_SERVER_DEV_MODE"] == "1"


@pytest.mark.feature("C4")
def test_model_mounts() -> None:
    m, path = model_mount("/data/models/qwen/../qwen", "vllm")
    assert m is not None
    assert (m.source, m.target, m.read_only, path) == (
        "/data/models/qwen",
        "/data/models/qwen",
        True,
        "/data/models/qwen",
    )
    m, path = model_mount("qwen-7b", "vllm")
    assert m is not None and m.source == "/data/models/qwen-7b" and path == m.target
    assert model_mount("/engines/llama", "trtllm") == (None, "/engines/llama")
    assert model_mount("", "vllm") == (None, "")


@pytest.mark.feature("C5")
def test_shared_memory_by_shape() -> None:
    assert shared_memory("single", 1) == (None, None, None)
    assert shared_memory("split", 1) == (None, None, None)
    # a private IPC namespace with a 16 GB /dev/shm: never the host's (issue 10)
    assert shared_memory("tensor_parallel", 2) == (None, "16g", None)
    assert shared_memory("pipeline", 1) == (None, "16g", "host")
    # vLLM's engine core and worker share a 160 MiB ring: more than Docker's 64 MB
    for engine in ("vllm", "vllm-mtt"):
        assert shared_memory("single", 1, engine) == (None, "16g", None)
        assert shared_memory("split", 0, engine) == (None, "16g", None)
    assert shared_memory("single", 1, "llamacpp") == (None, None, None)


# --- environment rules (C3 extended, issue 10) --------------------------------------------


@pytest.mark.parametrize(
    ("item", "verdict"),
    [
        ("VLLM_LOGGING_LEVEL=DEBUG", ""),
        ("NCCL_DEBUG=INFO", ""),
        ("HF_HUB_OFFLINE=1", ""),
        ("OMP_NUM_THREADS=4", ""),
        ("TZ=UTC", ""),
        ("BARE", ""),  # dropped by C3, not refused
        ("CUDA_VISIBLE_DEVICES=0", ""),  # agent-owned: dropped, not refused
        ("LD_PRELOAD=/x.so", "may never be set"),
        ("ld_preload=/x.so", "may never be set"),
        ("PYTHONWARNINGS=x", "may never be set"),
        ("BROWSER=sh", "may never be set"),
        ("https_proxy=http://a:1", "may never be set"),
        ("HETEROFLOW_NODE_TOKEN=x", "may never be set"),
        ("JAVA_TOOL_OPTIONS=-javaagent:x", "may never be set"),
        ("MY_APP_SETTING=1", "not in the allowed variables"),
        ("1BAD=1", "not a valid variable name"),
    ],
)
def test_env_rules_allow_engine_knobs_and_refuse_hooks(item: str, verdict: str) -> None:
    problem = env_problem(item)
    assert (verdict in problem) if verdict else problem == ""


def test_an_operator_extends_the_allow_list_but_never_the_deny_list() -> None:
    allow = (*DEFAULT_ENV_ALLOW, "MY_APP_*", "LD_PRELOAD", "PYTHON*")
    assert env_problem("MY_APP_SETTING=1", allow) == ""
    assert "may never be set" in env_problem("LD_PRELOAD=/x.so", allow)
    assert "may never be set" in env_problem("PYTHONPATH=/x", allow)
    assert env_allowed("MY_APP_X", allow) and not env_denied("MY_APP_X")


def test_every_container_is_confined() -> None:
    """No privileges, capabilities dropped, no-new-privileges: the dry run and the
    runtime both take the plan's default (issue 10)."""
    plan = ContainerPlan(
        name="task-000000000001", image="x", entrypoint=None, command=(), env={},
        ports={}, mounts=(), ipc_mode=None, shm_size=None, network_mode=None, gpu=None,
        labels={},
    )
    assert plan.security.privileged is False
    assert plan.security.cap_drop == ("ALL",)
    assert "SYS_ADMIN" not in plan.security.cap_add
    assert "no-new-privileges:true" in plan.security.security_opt
