"""Tensor-parallel ranks as Ray actors (distributed_executor_backend="ray"), so that one engine can span machines.

Ray places and starts ranks 1..N-1 (a placement group, packed onto as few nodes as it can) and tells how they
ended; what the ranks say to each other still goes over torch.distributed, exactly as with local processes,
after a TCP rendezvous on the engine's node. Rank 0 stays the engine's own process, on the engine's device.
An accelerator rank holds one device, which Ray makes the only one its process sees (CUDA_VISIBLE_DEVICES,
ASCEND_RT_VISIBLE_DEVICES), so it runs on <type>:0. Ray is an optional extra: pip install 'npu-llm[ray]'.
"""
from __future__ import annotations

import os
import socket

from backend.config import EngineConfig
from backend.distributed import TensorParallel, init_tensor_parallel, timeout
from backend.engine.executor import Workers, run_worker, share_cpu_threads

# What the ranks need from the engine's environment: an actor starts from its raylet's environment, not ours.
PASSED_ENV = ("NPU_LLM_DISTRIBUTED_TIMEOUT_S", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HCCL_IF_IP",
              "HCCL_SOCKET_IFNAME", "HCCL_CONNECT_TIMEOUT")


class Rank:
    """One worker rank, as a Ray actor: run() is its whole life (run_worker's loop)."""

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

        if grace_s:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=grace_s)
        for actor in self.actors:
            ray.kill(actor)
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
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'npu-llm[ray]'") from None
    started_ray = not ray.is_initialized()
    if started_ray:  # the cluster `ray start` runs on this machine (or RAY_ADDRESS's), else a local instance
        ray.init(include_dashboard=False, log_to_driver=False)
    size = config.tensor_parallel_size
    threads = share_cpu_threads(device.type, size)
    accelerators = {"cuda": {"num_gpus": 1}, "npu": {"resources": {"NPU": 1}}}.get(device.type, {})
    bundle = {"CPU": threads if device.type == "cpu" else 1, "GPU": accelerators.get("num_gpus", 0),
              **accelerators.get("resources", {})}
    group = placement_group([{k: v for k, v in bundle.items() if v}] * (size - 1), strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout().total_seconds())
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"the Ray cluster has no room for {size - 1} ranks of {bundle} (see `ray status`)") from None
    host = ray.util.get_node_ip_address()
    init_method = f"tcp://{host}:{_free_port(host)}"
    env = {key: os.environ[key] for key in PASSED_ENV if key in os.environ}
    actor_class = ray.remote(Rank)
    actors = [actor_class.options(
        num_cpus=bundle["CPU"], **accelerators, runtime_env={"env_vars": env} if env else None,
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)).remote()
        for i in range(size - 1)]
    rank_device = "cpu" if device.type == "cpu" else f"{device.type}:0"
    runs = [actor.run.remote(config, rank_device, rank, size, init_method, threads)
            for rank, actor in enumerate(actors, start=1)]
    workers = RayWorkers(actors, runs, group, None, started_ray)
    try:
        tp, workers.control = init_tensor_parallel(device.type, 0, size, init_method)
    except BaseException:
        workers._end(grace_s=0)
        raise
    return tp, workers


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
