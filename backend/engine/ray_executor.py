"""Tensor-parallel ranks as Ray actors (distributed_executor_backend="ray"), so that one engine can span machines.

Ray places and starts ranks 1..N-1 (a placement group, packed onto as few nodes as it can) and tells how they
ended; what the ranks say to each other still goes over torch.distributed, exactly as with local processes,
after a TCP rendezvous on the engine's node. Rank 0 stays the engine's own process, on the engine's device.
An accelerator rank holds one device, which Ray makes the only one its process sees (CUDA_VISIBLE_DEVICES,
ASCEND_RT_VISIBLE_DEVICES), so it runs on <type>:0. Rank 0's device is never a rank's: a Ray instance the
engine starts itself does not see it, and a cluster that places a rank on it fails the start, saying how to
start Ray without it. Ray is an optional extra: pip install 'npu-llm[ray]'.
"""
from __future__ import annotations

import os

from backend.config import EngineConfig
from backend.config.addresses import free_port
from backend.distributed import TensorParallel, init_tensor_parallel, timeout
from backend.engine.workers import Workers, run_worker, share_cpu_threads
from backend.platform import VISIBLE_DEVICES

# What the ranks need from the engine's environment: an actor starts from its raylet's environment, not ours.
PASSED_ENV = ("NPU_LLM_DISTRIBUTED_TIMEOUT_S", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HCCL_IF_IP",
              "HCCL_SOCKET_IFNAME", "HCCL_CONNECT_TIMEOUT", "NPU_LLM_CPU_ISA", "NPU_LLM_CPU_KERNELS")


# Ray's resource for each accelerator (it shows a rank its device through platform.VISIBLE_DEVICES).
RESOURCES = {"cuda": "GPU", "npu": "NPU"}


class Rank:
    """One worker rank, as a Ray actor: run() is its whole life (run_worker's loop)."""

    def place(self, accelerator: str) -> tuple[str, list[str]]:
        """(its node's address, the ids of the accelerators Ray gave it)."""
        import ray

        return ray.util.get_node_ip_address(), list(ray.get_runtime_context().get_accelerator_ids()[accelerator])

    def run(self, *args) -> None:
        run_worker(*args)


class RayWorkers(Workers):
    def __init__(self, actors: list, runs: list, group, control, started_ray: bool):
        super().__init__(control)
        self.actors, self.runs = actors, runs  # rank 1 first; runs: each actor's run() (an ObjectRef)
        self.group = group  # the placement group holding their resources
        self.started_ray = started_ray  # the engine started a Ray instance of its own: it stops it too

    def _end(self, grace_s: float) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if grace_s and self.runs:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=grace_s)
        for actor in self.actors:
            ray.kill(actor)
        if self.group is not None:
            remove_placement_group(self.group)
        if self.started_ray:
            ray.shutdown()

    def states(self, wait_s: float = 0) -> list[str]:
        import ray

        ended, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=wait_s)
        return ["running" if run not in ended else _how_it_ended(run) for run in self.runs]


def _how_it_ended(run) -> str:
    import ray

    try:
        ray.get(run, timeout=0)
        return "exited"
    except ray.exceptions.RayError as e:
        return f"failed: {str(e).splitlines()[0][:200]}"


def start_ray_workers(config: EngineConfig, device) -> tuple[TensorParallel, RayWorkers]:
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'npu-llm[ray]'") from None
    started_ray = not ray.is_initialized()
    if started_ray:  # the cluster `ray start` runs on this machine (or RAY_ADDRESS's), else a local instance
        _init_ray_without(device)
    workers = RayWorkers([], [], None, None, started_ray)
    try:
        return _start(ray, config, device, workers), workers
    except BaseException:
        workers._end(grace_s=0)  # no actor, placement group or Ray instance of ours outlives a failed start
        raise


def _start(ray, config: EngineConfig, device, workers: RayWorkers) -> TensorParallel:
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    size = config.tensor_parallel_size
    threads = share_cpu_threads(device.type, size)
    accelerator = RESOURCES.get(device.type)
    bundle = {"CPU": threads if accelerator is None else 1, **({accelerator: 1} if accelerator else {})}
    workers.group = placement_group([bundle] * (size - 1), strategy="PACK")
    try:
        ray.get(workers.group.ready(), timeout=timeout().total_seconds())
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"the Ray cluster has no room for {size - 1} ranks of {bundle} (see `ray status`)") from None
    env = {key: os.environ[key] for key in PASSED_ENV if key in os.environ}
    options = {"num_gpus": 1} if accelerator == "GPU" else {"resources": {accelerator: 1}} if accelerator else {}
    workers.actors = [ray.remote(Rank).options(
        num_cpus=bundle["CPU"], **options, runtime_env={"env_vars": env} if env else None,
        scheduling_strategy=PlacementGroupSchedulingStrategy(workers.group, placement_group_bundle_index=i)).remote()
        for i in range(size - 1)]
    host = ray.util.get_node_ip_address()
    if accelerator:
        _check_not_ours(ray.get([actor.place.remote(accelerator) for actor in workers.actors]), host, device)
    init_method = f"tcp://{host}:{free_port(host)}"
    rank_device = "cpu" if accelerator is None else f"{device.type}:0"  # (the one device Ray lets it see)
    workers.runs = [actor.run.remote(config, rank_device, rank, size, init_method, threads)
                    for rank, actor in enumerate(workers.actors, start=1)]
    tp, workers.control = init_tensor_parallel(device.type, 0, size, init_method)
    return tp


def _init_ray_without(device) -> None:
    """A local Ray instance that cannot hand out the engine's own device: its raylet starts with that device
    hidden (our process has opened its devices already, so the variable no longer changes what it sees)."""
    import ray

    variable = VISIBLE_DEVICES.get(device.type)
    if variable is None:
        ray.init(include_dashboard=False, log_to_driver=False)
        return
    saved = os.environ.get(variable)
    ids = _visible_ids(device.type)
    os.environ[variable] = ",".join(i for i in ids if i != ids[device.index or 0])
    try:
        ray.init(include_dashboard=False, log_to_driver=False)
    finally:
        if saved is None:
            del os.environ[variable]
        else:
            os.environ[variable] = saved


def _visible_ids(device_type: str) -> list[str]:
    """The physical ids of the devices this process sees, in its own order (device k is the k-th)."""
    import torch

    listed = os.environ.get(VISIBLE_DEVICES[device_type])
    count = torch.cuda.device_count() if device_type == "cuda" else torch.npu.device_count()
    return listed.split(",")[:count] if listed else [str(i) for i in range(count)]


def _check_not_ours(places: list[tuple[str, list[str]]], host: str, device) -> None:
    """A rank Ray placed on the engine's own device (a cluster started on this machine with every device)."""
    ours = _visible_ids(device.type)[device.index or 0]
    for rank, (node, ids) in enumerate(places, start=1):
        if node == host and ours in ids:
            variable = VISIBLE_DEVICES[device.type]
            raise RuntimeError(f"Ray gave rank {rank} the engine's own device ({device}, id {ours}): start Ray on "
                               f"this machine without it, e.g. {variable}=<the other ids> ray start --head")

