"""Data parallelism (`--dp N`): N engine replicas behind one API server, one request on one replica for its life.

`start_replicas` starts N engine processes from the same flags, each on its own CUDA devices or all sharing one
(`placement`); `ReplicaClient` is the HTTP process's client of all of them, with the interface of one
`EngineClient`: `submit` asks the balancer for a replica, `abort` and `release` follow the request to its
replica. A replica whose process dies fails only its own requests (its in-flight ones at once, with an error
naming the replica); the others keep serving and the balancer stops choosing it. Then a fresh engine is started
in its place (`restart.py`: bounded attempts with backoff), which takes requests once it is ready.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import msgspec

from lightllm.cache.prefix.namespace import salt_namespace
from lightllm.engine.messages import EngineStats, Finished, NewRequest
from lightllm.server.args import ServerArgs
from lightllm.server.dp.balancer import NoReplicaAlive, RoutedPrompt, create_balancer
from lightllm.server.dp.placement import Placement, place_replicas, visible_cuda_devices
from lightllm.server.dp.replica_metrics import ReplicaCollector, replica_rows
from lightllm.server.dp.restart import ReplicaRestarter, RestartPolicy
from lightllm.server.host_tier import start_with_host_tier
from lightllm.server.http.engine_client import EngineClient
from lightllm.server.launcher import EngineHandle, spawn_engine, start_engine
from lightllm.server.model_info import ModelInfo
from lightllm.server.prestart import PrestartedEngine

logger = logging.getLogger(__name__)

# seconds between checks of the replicas' processes
REPLICA_CHECK_INTERVAL_S = 0.5


def replica_placement(args: ServerArgs, num_devices: int | None = None) -> Placement | None:
    """Where the replicas run over `num_devices` visible CUDA devices (default: those this process sees); None on
    a CPU. Logs once when the replicas share a device."""
    if args.device != "cuda":
        return None
    placement = place_replicas(args.dp, args.tp, visible_cuda_devices() if num_devices is None else num_devices)
    if placement.shared and args.dp > 1:
        if args.max_total_token_num is not None:
            share = f"--max_total_token_num {args.max_total_token_num}"
        else:
            share = f"1/{args.dp} of --mem_fraction ({placement.mem_fraction(args.mem_fraction):g})"
        logger.info(
            "the %d data-parallel replicas share CUDA device 0 (the only one visible), each with %s", args.dp, share
        )
    elif args.dp > 1:
        where = "; ".join(f"replica {i}: cuda:{', cuda:'.join(map(str, d))}" for i, d in enumerate(placement.devices))
        logger.info("data-parallel replicas on their own CUDA devices (%s)", where)
    return placement


def replica_args(args: ServerArgs, replica: int, placement: Placement | None) -> ServerArgs:
    """Replica `replica`'s flags: the same model and limits, on its own device(s) (`placement`; None: a CPU);
    replicas sharing a device split the memory share."""
    if placement is None:
        return args
    mem_fraction = args.mem_fraction
    if args.max_total_token_num is None:
        mem_fraction = placement.mem_fraction(args.mem_fraction)
    return dataclasses.replace(args, base_device=placement.base_device(replica), mem_fraction=mem_fraction)


def start_engines(
    args: ServerArgs, info: ModelInfo, runner_factory: str, prestarted: PrestartedEngine | None = None
) -> EngineHandle | ReplicaSet:
    """The engine the API server talks to, with the host tier its engines share when it is on
    (`server.host_tier`); `prestarted` becomes the (first) engine process."""
    return start_with_host_tier(args, lambda args: _start_engines(args, info, runner_factory, prestarted))


def _start_engines(
    args: ServerArgs, info: ModelInfo, runner_factory: str, prestarted: PrestartedEngine | None
) -> EngineHandle | ReplicaSet:
    """One engine process, or with `--dp N` a set of N replicas."""
    if args.dp == 1:
        return start_engine(args, info, runner_factory, prestarted)
    placement = replica_placement(args)
    policy = RestartPolicy(args.dp_restart_attempts, args.dp_restart_backoff_s)

    def spawn(replica: int):
        return spawn_engine(replica_args(args, replica, placement), info, runner_factory)

    restarter = ReplicaRestarter(args.dp, policy, spawn)
    return ReplicaSet(start_replicas(args, info, runner_factory, placement, prestarted), restarter)


def start_replicas(
    args: ServerArgs,
    info: ModelInfo,
    runner_factory: str,
    placement: Placement | None,
    prestarted: PrestartedEngine | None = None,
) -> list[EngineHandle]:
    """Start `args.dp` engine processes one after another, replica 0 in `prestarted` when given (a start-up
    failure stops those already started)."""
    handles: list[EngineHandle] = []
    try:
        for replica in range(args.dp):
            ready = prestarted if replica == 0 else None
            handles.append(start_engine(replica_args(args, replica, placement), info, runner_factory, ready))
    except BaseException:
        for handle in handles:
            handle.stop()
        raise
    return handles


class ReplicaSet:
    """The replicas' processes, seen by the app as one engine: alive while any replica is alive or may be
    restarted."""

    def __init__(self, handles: list[EngineHandle], restarter: ReplicaRestarter):
        self.handles = handles
        self.restarter = restarter
        # the HTTP process's client, once `connect` made it
        self.client: ReplicaClient | None = None

    @property
    def capacity_report(self) -> str:
        return f"{len(self.handles)} data-parallel replicas, each {self.handles[0].capacity_report}"

    def is_alive(self) -> bool:
        return self.num_alive() > 0 or self.restarter.may_serve_again()

    def num_alive(self) -> int:
        return sum(h.is_alive() for h in self.handles)

    def accepts_requests(self) -> bool:
        """While every replica is down (some restarting) new requests are refused with 503, not failed."""
        return self.num_alive() > 0

    def connect(self, args: ServerArgs) -> ReplicaClient:
        self.client = ReplicaClient(self, args.dp_balancer, args.prefix_cache_checkpoint_interval)
        return self.client

    def health(self) -> dict:
        """/health's body while any replica is alive: "degraded" when some are not."""
        alive = self.num_alive()
        status = "ok" if alive == len(self.handles) else "degraded"
        return {
            "status": status,
            "replicas": len(self.handles),
            "replicas_alive": alive,
            "replicas_restarting": len(self.restarter.restarting),
        }

    def serving_problem(self) -> str | None:
        """Why nothing can be served now although a replica is restarting (None: some replica serves)."""
        if self.num_alive() == 0:
            return f"no data-parallel replica is running ({len(self.restarter.restarting)} restarting)"
        return None

    def add_routes(self, app) -> None:
        """`GET /dp/replicas`: every replica's liveness, restarts, routing, load and prefix hits (JSON)."""

        async def replicas():
            return {"replicas": replica_rows(self.client) if self.client is not None else []}

        app.add_api_route("/dp/replicas", replicas, methods=["GET"])

    def register_metrics(self, registry) -> None:
        """Per-replica gauges and counters (label `replica`) on the server's /metrics."""
        registry.register(ReplicaCollector(lambda: self.client))

    def exit_description(self) -> str:
        return "every replica exited: " + ", ".join(h.exit_description() for h in self.handles)

    def stop(self, timeout_s: float = 10.0) -> None:
        for handle in self.handles:
            handle.stop(timeout_s)


def _summed(parts: list[EngineStats]) -> EngineStats:
    """One snapshot for the whole server: counters and gauges summed over replicas (histograms element-wise)."""
    total = EngineStats()
    for part in parts:
        for field in msgspec.structs.fields(EngineStats):
            mine, theirs = getattr(total, field.name), getattr(part, field.name)
            if isinstance(theirs, int) and not isinstance(theirs, bool):
                setattr(total, field.name, (mine or 0) + theirs)
            elif isinstance(theirs, list):
                merged = [a + b for a, b in zip(mine, theirs)] + mine[len(theirs) :] + theirs[len(mine) :]
                setattr(total, field.name, merged)
            elif isinstance(theirs, dict):
                setattr(total, field.name, {k: mine.get(k, 0) + theirs.get(k, 0) for k in {*mine, *theirs}})
    return total


class ReplicaClient:
    """`EngineClient`'s interface over every replica (see the module docstring)."""

    def __init__(self, replicas: ReplicaSet, balancer: str, block_tokens: int):
        self.replicas = replicas
        self.clients = [EngineClient(h.input_addr, h.output_addr) for h in replicas.handles]
        self.balancer = create_balancer(balancer, block_tokens)
        self.alive = [True] * len(self.clients)
        # request id -> its replica, from submit until it finishes or is released
        self._replica_of: dict[str, int] = {}
        # routing decisions per replica (metrics)
        self.num_routed = [0] * len(self.clients)
        self.observers: list = []
        for i, client in enumerate(self.clients):
            client.observers.append(self._observer(i))
        self._watch: asyncio.Task | None = None
        # replica -> the task starting a fresh engine in its place
        self._rejoins: dict[int, asyncio.Task] = {}

    def _observer(self, replica: int):
        def observe(out) -> None:
            if isinstance(out, Finished):
                self._replica_of.pop(out.req_id, None)
            for observe_all in self.observers:
                observe_all(out)

        return observe

    def start(self) -> None:
        for client in self.clients:
            client.start()
        self._watch = asyncio.get_running_loop().create_task(self._watch_replicas())

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        for task in self._rejoins.values():
            task.cancel()
        for client in self.clients:
            await client.close()

    @property
    def stats(self) -> EngineStats:
        return _summed([c.stats for c, up in zip(self.clients, self.alive) if up])

    @property
    def num_in_flight(self) -> int:
        return sum(c.num_in_flight for c in self.clients)

    def loads(self) -> list[int]:
        return [c.num_in_flight for c in self.clients]

    async def submit(self, req: NewRequest, queue: asyncio.Queue) -> None:
        # a death the watch has not seen yet must not take this request too
        self._notice_deaths()
        try:
            prompt = RoutedPrompt(req.prompt_ids, salt_namespace(req.cache_salt))
            replica = self.balancer.choose(prompt, self.loads(), self.alive)
        except NoReplicaAlive:
            queue.put_nowait(Finished(req.req_id, "error", error="no data-parallel replica is running"))
            return
        self._replica_of[req.req_id] = replica
        self.num_routed[replica] += 1
        await self.clients[replica].submit(req, queue)

    def abort(self, req_id: str) -> None:
        replica = self._replica_of.get(req_id)
        if replica is not None:
            self.clients[replica].abort(req_id)

    def release(self, req_id: str) -> None:
        replica = self._replica_of.pop(req_id, None)
        if replica is not None:
            self.clients[replica].release(req_id)

    def fail_all(self, error: str) -> None:
        for client in self.clients:
            client.fail_all(error)
        self._replica_of.clear()

    def replica_exited(self, replica: int) -> None:
        """Fail the requests of a replica whose process died; the others go on."""
        if not self.alive[replica]:
            return
        self.alive[replica] = False
        client = self.clients[replica]
        logger.error(
            "data-parallel replica %d exited (exit code %s); failing its %d sequences in flight, %d replicas left",
            replica,
            self.replicas.handles[replica].process.exitcode,
            client.num_in_flight,
            sum(self.alive),
        )
        client.fail_all(f"data-parallel replica {replica} exited")
        self._replica_of = {r: i for r, i in self._replica_of.items() if i != replica}
        self.balancer.forget_replica(replica)
        if self.replicas.restarter.policy.attempts > 0 and replica not in self._rejoins:
            self._rejoins[replica] = asyncio.get_running_loop().create_task(self._rejoin(replica))

    async def _rejoin(self, replica: int) -> None:
        """Start a fresh engine in place of a dead replica; once ready, route requests to it again."""
        try:
            handle = await self.replicas.restarter.restart(replica)
            if handle is None:
                return
            self.replicas.handles[replica].stop()
            self.replicas.handles[replica] = handle
            old, self.clients[replica] = self.clients[replica], EngineClient(handle.input_addr, handle.output_addr)
            self.clients[replica].observers.append(self._observer(replica))
            self.clients[replica].start()
            old.fail_all(f"data-parallel replica {replica} exited")
            await old.close()
            # a fresh engine holds no prefix
            self.balancer.forget_replica(replica)
            self.alive[replica] = True
            logger.info("data-parallel replica %d rejoined; %d replicas serving", replica, sum(self.alive))
        finally:
            self._rejoins.pop(replica, None)

    def _notice_deaths(self) -> None:
        for i, handle in enumerate(self.replicas.handles):
            if self.alive[i] and not handle.is_alive():
                self.replica_exited(i)

    async def _watch_replicas(self) -> None:
        while True:
            self._notice_deaths()
            for i, up in enumerate(self.alive):
                if not up:
                    # a request routed just before the death must not wait forever
                    self.clients[i].fail_all(f"data-parallel replica {i} exited")
            await asyncio.sleep(REPLICA_CHECK_INTERVAL_S)
