"""Colocated SGLang servers on every node of a multi-node job.

Each node's first rank (its local rank 0, the node leader) launches that node's servers on the
node's own GPUs and owns them: memory release after the rollout, resume before the weight push,
restarts. The server URLs are gathered over torch.distributed at start; global rank 0 holds one
generation client over all of them (`ClusterClient`: the SGLang client's exactly-once slots and
retries, plus a server that refuses connections is left out of the rotation until the next
weight sync). Weights go from the learner ranks of a node to that node's servers only
(`multinode_sync`).

Nodes are told apart by torchrun's GROUP_RANK (its node rank), else by host name; node k is the
k-th distinct node in rank order. Node k's server i listens on the first free port from
`base_port + k * num_servers + i` (distinct also when several nodes share one host), uses the
node's GPUs `base_gpu_id + i * tp_size ...`, the seed `seed + k * num_servers + i` and logs to
`log_dir/node<k>/`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import torch
import torch.distributed as dist

from megatron_gspo.data.sample import Sample
from megatron_gspo.rollout.engine import GenerateRequest, RolloutEngine, RolloutError
from megatron_gspo.rollout.sglang.client import SGLangEngine
from megatron_gspo.rollout.sglang.launch import (
    LaunchSpec,
    ServerProcess,
    pick_dist_port,
    pick_ports,
    server_argv,
    server_env,
)


def nodes_in_job(env: dict[str, str] | None = None) -> int:
    """Nodes of this torchrun job from WORLD_SIZE / LOCAL_WORLD_SIZE (1 without them)."""
    env = os.environ if env is None else env
    world, local = int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_WORLD_SIZE", "0") or 0)
    return -(-world // local) if local > 0 else 1


@dataclass(frozen=True)
class NodeLayout:
    """Which node every global rank runs on.

    Attributes:
        node_of: node index of each global rank (node 0 holds rank 0).
        devices: CUDA device of each global rank (None without CUDA).
        rank: this process's global rank.
        hosts: host name of each global rank.
    """

    node_of: tuple[int, ...]
    devices: tuple[int | None, ...]
    rank: int = 0
    hosts: tuple[str, ...] = ()
    groups: tuple[Any, ...] = dataclasses.field(default=(), compare=False, repr=False)
    cpu_world: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def nodes(self) -> int:
        return max(self.node_of) + 1

    @property
    def node(self) -> int:
        return self.node_of[self.rank]

    def ranks_of(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def leader(self, node: int) -> int:
        """Lowest global rank on `node` (its local rank 0)."""
        return self.ranks_of(node)[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader(self.node)


def layout_from(infos: Sequence[tuple], rank: int = 0) -> NodeLayout:
    """NodeLayout from each rank's (node key, CUDA device, host name), by rank."""
    keys: dict[str, int] = {}
    for key, *_ in infos:
        keys.setdefault(key, len(keys))
    return NodeLayout(tuple(keys[i[0]] for i in infos), tuple(i[1] for i in infos), rank,
                      tuple(i[2] for i in infos))


_LAYOUT: NodeLayout | None = None


def gather_layout() -> NodeLayout:
    """The job's NodeLayout (collective on first call, cached after): every rank's node key
    and device are all-gathered, and one gloo group per node plus one over all ranks are made
    for the small object gathers of the weight sync."""
    global _LAYOUT
    if _LAYOUT is not None:
        return _LAYOUT
    key, host = os.environ.get("GROUP_RANK"), socket.gethostname()
    me = (f"group {key}" if key is not None else f"host {host}",
          torch.cuda.current_device() if torch.cuda.is_available() else None, host)
    if not (dist.is_available() and dist.is_initialized()):
        _LAYOUT = layout_from([me])
        return _LAYOUT
    infos: list = [None] * dist.get_world_size()
    dist.all_gather_object(infos, me)
    base = layout_from(infos, dist.get_rank())
    groups = tuple(dist.new_group(base.ranks_of(n), backend="gloo") for n in range(base.nodes))
    _LAYOUT = dataclasses.replace(base, groups=groups,
                                  cpu_world=dist.new_group(backend="gloo"))
    return _LAYOUT


def node_spec(spec: LaunchSpec, node: int) -> LaunchSpec:
    """Node `node`'s launch: ports, seeds and log directory shifted as the module says."""
    shift = node * spec.num_servers
    return dataclasses.replace(
        spec, base_port=spec.base_port + shift if spec.base_port else 0, seed=spec.seed + shift,
        log_dir=os.path.join(spec.log_dir, f"node{node}") if spec.log_dir else None)


def _can_listen(host: str, port: int) -> bool:
    """True when a server may listen on host:port again: nothing listens there (connections
    of the dead server left in TIME_WAIT do not count; servers bind with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


class NodeServers(SGLangEngine):
    """The servers one node leader launched: memory release (of the servers still running),
    resume, weight pushes (`SGLangEngine`'s), and restarts of servers that died."""

    def __init__(self, node: int, launch: LaunchSpec, **kw: Any) -> None:
        super().__init__(launch=launch, **kw)
        self.node = node

    def live_urls(self) -> list[str]:
        return [u for u, p in zip(self.urls, self.procs, strict=True) if p.alive()]

    async def arelease_memory(self, tags: Sequence[str] | None = None) -> None:
        busy = sum(self._inflight.values())
        if busy:
            raise RolloutError(f"node {self.node}: release_memory with {busy} requests in flight")
        body = {"tags": list(tags) if tags else None}  # the dead restart at the next sync
        await self._memory_call(self.live_urls(), "/release_memory_occupation", body)

    def restart_dead(self) -> list[str]:
        """Relaunch every server process that has exited (same port when it is free), wait for
        its health, check its /server_info and release its memory as the others' is.

        Returns:
            one note per restarted server.
        Raises:
            RolloutError naming the node and the server when a restart fails.
        """
        return self.sync(self._arestart_dead())

    async def _arestart_dead(self) -> list[str]:
        spec, notes, hold = self.spec, [], self.port_hold()
        assert spec is not None
        for i, old in enumerate(self.procs):
            if old.alive():
                continue
            why = old.describe()
            await asyncio.to_thread(old.stop)
            port = int(self.urls[i].rsplit(":", 1)[1])
            if not _can_listen(spec.host, port):
                port = pick_ports(spec.host, spec.base_port, 1, self._ports(), hold=hold)[0]
            logp = os.path.join(spec.log_dir, f"sglang_server_{i}.log") if spec.log_dir else None
            argv = server_argv(spec, i, port, pick_dist_port([*self._ports(), port], hold=hold))
            proc = ServerProcess(argv, f"sglang server {i} (port {port})", server_env(spec), logp)
            url = f"http://{spec.host}:{port}"
            self.procs[i], self.urls[i] = proc, url
            try:
                await self._wait_healthy(url, proc)
                info = await self._read_server_info(url)
                self._check_server_info([info if u == url else self.server_info[u]
                                         for u in self.urls])
                if self.released_tags:
                    await self._memory_call([url], "/release_memory_occupation",
                                            {"tags": sorted(self.released_tags)})
            except RolloutError as e:
                raise RolloutError(f"node {self.node}: restarting server {i} failed: {e}") from e
            self._inflight[url] = 0
            notes.append(f"node {self.node}: restarted server {i} at {url} ({why})")
        return notes

    def _ports(self) -> list[int]:
        return [int(u.rsplit(":", 1)[1]) for u in self.urls]


class ClusterClient(SGLangEngine):
    """Generation over every node's servers (attached by URL): `SGLangEngine`'s slots and
    retries; a server that refuses connections is left out of the rotation (`down`) until
    `set_urls` is called after the next weight sync."""

    def __init__(self, server_urls: Sequence[str], **kw: Any) -> None:
        super().__init__(server_urls=server_urls, **kw)
        self.down: set[str] = set()

    def set_urls(self, urls: Sequence[str], version: int) -> None:
        """The servers after a weight sync (restarted ones may have new URLs), all at
        `version`; nothing is down any more."""
        self.urls = [u.rstrip("/") for u in urls]
        for u in self.urls:
            self._inflight.setdefault(u, 0)
        self.down.clear()
        self._version = int(version)

    def _pick(self, avoid: str | None) -> str:
        up = [u for u in self.urls if u not in self.down]
        cands = [u for u in up if u != avoid] or up or self.urls
        return min(cands, key=lambda u: self._inflight.get(u, 0))

    async def _post_generate(self, url: str, body: dict[str, Any], where: str) -> Any:
        try:
            return await super()._post_generate(url, body, where)
        except Exception as e:
            if isinstance(e.__cause__, aiohttp.ClientConnectorError):
                self.down.add(url)  # nothing listens there: its node restarts it at the sync
            raise


class MultiNodeEngine(RolloutEngine):
    """Rank 0's engine: generation through `client` (all nodes' servers), memory calls on
    `local` (node 0's servers; the other node leaders release and resume their own)."""

    def __init__(self, local: NodeServers, client: ClusterClient) -> None:
        super().__init__(client.default_sampling)
        self.local, self.client = local, client

    @property
    def weight_version(self) -> int:
        return self.client.weight_version

    @property
    def metrics(self) -> dict[str, int]:
        return self.client.metrics

    @property
    def memory_released(self) -> bool:
        return self.local.memory_released

    async def agenerate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        if self.local.memory_released:
            raise RolloutError("generate called while the servers' memory is released; "
                               "resume_memory first")
        return await self.client.agenerate(requests)

    async def aupdate_weights(self, buckets: Any, version: int) -> None:
        raise RolloutError("colocated servers on several nodes take weights through the "
                           "collective multi-node sync (every rank takes part)")

    async def aprobe_servers(self, *args: Any, **kw: Any) -> list:
        """The sync probe on every node's servers (`SGLangEngine.aprobe_servers`)."""
        return await self.client.aprobe_servers(*args, **kw)

    def sync(self, coro: Any) -> Any:
        """Run one of this engine's coroutines synchronously (in its loop, as generation)."""
        return self._run(coro)

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        self.local.release_memory(tags)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self.local.resume_memory(tags)

    async def ahealth(self) -> bool:
        return await self.client.ahealth()

    async def ashutdown(self) -> None:
        await self.client.ashutdown()  # in this engine's loop, where its session lives

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self.local.shutdown()


def node_engine(engine: Any) -> NodeServers | None:
    """The servers this process owns: a node leader's NodeServers (rank 0: its `local`)."""
    return engine.local if isinstance(engine, MultiNodeEngine) else engine


def agree(layout: NodeLayout, error: str | None) -> None:
    """Raise the same one-line RolloutError on every rank when any rank reports an error
    (collective; the first node's error by rank order)."""
    errors: list = [error]
    if dist.is_available() and dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error, group=layout.cpu_world)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise RolloutError(first)


def gather_urls(layout: NodeLayout, urls: list[str] | None) -> list[list[str]]:
    """Every node's server URLs in node order (collective; `urls` from the node leaders)."""
    got: list = [urls]
    if dist.is_available() and dist.is_initialized():
        got = [None] * dist.get_world_size()
        dist.all_gather_object(got, urls, group=layout.cpu_world)
    return [got[layout.leader(n)] for n in range(layout.nodes)]


def _loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


def _route_address(host: str) -> str | None:
    """This machine's address on the route to `host` (a UDP socket's source address after
    `connect`, which sends nothing), or None when there is no route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def bind_host(value: str, environ=None) -> str:
    """`rollout.host` as this node's servers bind it: "internal" is the node's cluster-internal
    address (what its host name resolves to; when that is loopback, the address on the route
    to MASTER_ADDR), anything else is taken as is.

    Raises:
        ValueError (one line) when "internal" finds no address other nodes could reach.
    """
    if value != "internal":
        return value
    environ = os.environ if environ is None else environ
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = ""
    if not addr or _loopback(addr):
        master = environ.get("MASTER_ADDR") or ""
        addr = (_route_address(master) if master and not _loopback(master) else None) or ""
    if not addr or _loopback(addr) or addr == "0.0.0.0":
        raise ValueError(f"rollout.host=internal: {socket.gethostname()} resolves to no address "
                         "other nodes reach (and MASTER_ADDR gives no route); set rollout.host "
                         "to this node's address")
    return addr


def update_master_address(server_urls: Sequence[str], environ=None) -> str:
    """The learner's address for the servers' weight-update rendezvous (distributed sync).

    MASTER_ADDR (the default) is kept while every server is on this host or MASTER_ADDR is
    routable. docker/launch/torchrun.sh sets it to 127.0.0.1 on a single learner node; servers
    on other hosts would then connect to themselves: the address on the route to the first
    remote server is used instead.

    Raises:
        ValueError (one line) when servers are remote and no routable address is found.
    """
    environ = os.environ if environ is None else environ
    master = environ.get("MASTER_ADDR") or "127.0.0.1"
    remote = [h for h in (u.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
                          for u in server_urls) if not _loopback(h)]
    if not remote or not _loopback(master):
        return master
    found = _route_address(remote[0])
    if found is None or _loopback(found) or found == "0.0.0.0":
        raise ValueError(
            f"rollout.weight_sync_master: the servers ({remote[0]}, ...) are on other hosts and "
            f"MASTER_ADDR is {master}, which they cannot reach; set "
            "rollout.weight_sync_master=HOST:PORT to an address of this node they can reach")
    return found


def advertised(urls: Sequence[str]) -> list[str]:
    """`urls` as other nodes reach them: a server bound to every interface (0.0.0.0, ::) is
    named by the address this node's host name resolves to."""
    out = []
    for u in urls:
        scheme, rest = u.split("://", 1)
        host, port = rest.rsplit(":", 1)
        if host.strip("[]") in ("0.0.0.0", "::", ""):
            host = socket.gethostbyname(socket.gethostname())
        out.append(f"{scheme}://{host}:{port}")
    return out


def start_node_servers(spec: LaunchSpec, client_kw: dict[str, Any]) -> RolloutEngine | None:
    """Launch every node's servers from its leader and connect rank 0 to all (collective).

    Args:
        spec: the launch of one node (`node_spec` shifts it per node).
        client_kw: SGLangEngine keyword arguments (retries, timeouts, sampling, api_key, ...).
    Returns:
        rank 0: a MultiNodeEngine; other node leaders: their NodeServers; other ranks: None.
    Raises:
        RolloutError on every rank, naming the first node whose servers did not start.
    """
    layout = gather_layout()
    hosts = {layout.hosts[layout.leader(n)] for n in range(layout.nodes)}
    own, error = None, None
    if _loopback(spec.host) and len(hosts) > 1:  # told on every rank by agree() below
        error = (f"node {layout.node} ({socket.gethostname()}): rollout.host={spec.host}: its "
                 f"servers would not be reachable from the other hosts ({len(hosts)} hosts in "
                 "the job); set rollout.host: internal (each node's cluster-internal address) "
                 "or ROLLOUT_HOST")
    elif layout.is_leader:
        try:
            own = NodeServers(layout.node, node_spec(spec, layout.node), **client_kw)
            own.sync(own.astart())
        except Exception as e:  # reported to every rank below
            error = (f"node {layout.node} ({socket.gethostname()}): its rollout servers did not "
                     f"start: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    try:
        agree(layout, error)
    except RolloutError:
        if own is not None:
            own.shutdown()
        raise
    urls = gather_urls(layout, advertised(own.urls) if own is not None else None)
    if layout.rank != 0:
        return own
    assert own is not None
    client = ClusterClient([u for node in urls for u in node],
                           **{**client_kw, "tp_size": spec.tp_size})
    return MultiNodeEngine(own, client)
