"""Beyond one host: each host's target server serves its shard of every epoch, one torchrun world
(c10d rendezvous, gloo) spans the hosts, and every sample of every epoch is trained exactly once.

The pure part (which seqs a host serves, the per-host accounting, the config) is tested as
functions; the end-to-end part runs two "hosts" on this machine: two target servers with their own
ring names and endpoints, and one `torchrun --nnodes 2` agent per host, through a clean run, a
kill -9 of one host's trainer rank (torchrun restarts the world from the checkpoint) and a
kill -9 of one host's target server (restarted; the trainer ranks wait and re-attach).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from common.channel import DealerChannel
from common.cluster import accounting, count_by_host, epoch_ranges, host_shard, plan_shard, restrict
from common.config import ConfigError, load_config
from common.liveness import self_identity
from common.protocol import Hello, Reply, new_session_secret, next_rid, plan_id
from common.seqset import SeqSet
from e2e import Service, assert_exactly_once, ctl, load, wait_for, write_config
from target_server.delivery import TRAIN, DeliveryCore, EpochPlan, SlotView


# ---- pure functions ----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 100, 101])
@pytest.mark.parametrize("hosts", [1, 2, 3, 5])
def test_host_shards_cover_an_epoch_once_contiguous_and_balanced(n: int, hosts: int) -> None:
    seqs = range(40, 40 + n)
    shards = [host_shard(seqs, hosts, h) for h in range(hosts)]
    assert [s for shard in shards for s in shard] == list(seqs), "in order, each seq on exactly one host"
    assert all(shard.step == 1 for shard in shards)
    sizes = [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1, sizes


def test_host_shard_refuses_a_host_outside_the_cluster() -> None:
    for rank in (-1, 2):
        with pytest.raises(ValueError, match="host_rank"):
            host_shard(range(10), 2, rank)


def test_plan_shards_are_one_run_per_epoch_and_partition_the_plan() -> None:
    sizes = [7, 5, 9]
    total = sum(sizes)
    shards = [plan_shard(sizes, 3, h) for h in range(3)]
    assert all(s.num_ranges <= len(sizes) for s in shards), "a host's trained set stays a few runs"
    assert sum(s.size for s in shards) == total
    assert SeqSet.union_of(*shards) == SeqSet.from_ranges([(0, total)])
    for e, r in enumerate(epoch_ranges(sizes)):   # every host has its part of every epoch
        assert all(s.count_in(r.start, r.stop) in (len(r) // 3, len(r) // 3 + 1) for s in shards), e


def test_each_hosts_part_of_a_trained_set_recombines_to_the_union() -> None:
    # What the checkpoint holds (the union) splits into the hosts' HELLOs, and back, without loss
    sizes = [10, 10]
    have = SeqSet.from_ranges([(0, 3), (4, 12), (17, 20)])
    parts = [restrict(have, sizes, 2, h) for h in range(2)]
    assert parts[0] == SeqSet.from_ranges([(0, 3), (4, 5), (10, 12)])
    assert parts[1] == SeqSet.from_ranges([(5, 10), (17, 20)])
    assert SeqSet.union_of(*parts) == have
    assert count_by_host(have, sizes, 2) == [parts[0].size, parts[1].size] == [6, 8]
    assert restrict(have, sizes, 1, 0) == have
    report = accounting(count_by_host(have, sizes, 2), sizes)
    assert report["hosts"] == [{"host": 0, "batches_trained": 6, "batches_planned": 10},
                               {"host": 1, "batches_trained": 8, "batches_planned": 10}]
    assert report["total"] == {"batches_trained": 14, "batches_planned": 20}


def test_the_target_server_plans_only_its_hosts_shard() -> None:
    plan = EpochPlan([6, 4], num_hosts=2, host_rank=1)
    assert (plan.shard(0), plan.shard(1)) == (range(3, 6), range(8, 10))
    core = DeliveryCore(lambda e: [6, 4][:e], {"data": "d", "id": plan_id({"data": "d"})}, lease_s=60.0, announce_retry_s=1.0, num_hosts=2,
                        host_rank=1)
    assert list(core.todo(TRAIN, set(), [])) == [3, 4, 5], "before a HELLO: this host's shard of the first epoch"
    core.on_hello(b"r0", Hello(rid=1, job="j", secret="ab" * 16, rank=0, world=1, pid=1, start_time=1,
                               have=SeqSet([3, 8]), epochs=2, credit=2, heldout=False), 0.0, [], [])
    in_ring = [SlotView(worker=0, slot=0, pub_seq=1, ready=True, seq=4)]
    assert list(core.todo(TRAIN, set(), in_ring)) == [5, 9], "another host's seqs are never computed here"


def test_cluster_config_defaults_validation_and_per_host_override() -> None:
    cfg = load_config(None)
    assert (cfg.cluster.num_hosts, cfg.cluster.host_rank) == (1, 0)
    assert load_config(None, ["cluster.num_hosts=4", "cluster.host_rank=3"]).cluster.host_rank == 3
    with pytest.raises(ConfigError, match=r"cluster.host_rank: 2 is not a host of cluster.num_hosts 2 \(0 to 1"):
        load_config(None, ["cluster.num_hosts=2", "cluster.host_rank=2"])
    with pytest.raises(ConfigError, match="cluster.host_rank"):
        load_config(None, ["cluster.host_rank=-1"])
    with pytest.raises(ConfigError, match="cluster.num_hosts: at least 1"):
        load_config(None, ["cluster.num_hosts=0"])
    with pytest.raises(ConfigError, match="cluster.host_rank: expected int"):
        load_config(None, ["cluster.host_rank=one"])


def test_the_environment_sets_a_hosts_rank_under_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFPIPE_NUM_HOSTS", "3")
    monkeypatch.setenv("DFPIPE_HOST_RANK", "2")
    assert (load_config(None).cluster.num_hosts, load_config(None).cluster.host_rank) == (3, 2)
    assert load_config(None, ["cluster.host_rank=1"]).cluster.host_rank == 1, "--set wins"
    monkeypatch.setenv("DFPIPE_HOST_RANK", "")   # set but empty (compose's ${VAR:-}): the file's value
    assert load_config(None).cluster.host_rank == 0
    monkeypatch.setenv("DFPIPE_HOST_RANK", "3")
    with pytest.raises(ConfigError, match="cluster.host_rank: 3 is not a host"):
        load_config(None)


# ---- two hosts on this machine -----------------------------------------------------------------
HOSTS = 2
# As the deployment files set it: with the rendezvous store shared between restarts (torch's
# default), a restarted world can read the previous attempt's addresses (pytorch issue 135712)
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class Torchrun(Service):
    """A torchrun agent (and its rank) as a service of the test: its own process group, a log file."""

    def __init__(self, role: str, cmd: list[str], log_dir: Path) -> None:
        self.role = role
        self.log_path = log_dir / f"{role}-{time.time_ns()}.log"
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **TORCHRUN_ENV})
        Service.started.append(self)


class Host:
    """One "host": its target server (own ring name and endpoint, from the shared config with this
    host's cluster.host_rank) and, per test, its torchrun agent."""

    def __init__(self, rank: int, config: Path, log_dir: Path) -> None:
        self.rank, self.config, self.log_dir = rank, config, log_dir
        cfg = load(config)
        sock_dir = cfg["service"]["target_endpoint"].removeprefix("ipc://").rsplit("/", 1)[0]
        self.endpoint = f"ipc://{sock_dir}/target-h{rank}.sock"
        self.overrides = [f"cluster.host_rank={rank}", f"service.target_endpoint={self.endpoint}"]
        self.ring_name = f"{cfg['ring']['name']}-h{rank}"
        self.target: Service | None = None
        self.trainer: Torchrun | None = None

    def start_target(self) -> None:
        self.target = Service("target-server", self.config, self.log_dir,
                              overrides=[*self.overrides, f"ring.name={self.ring_name}"])

    def serving(self) -> dict | None:
        s = ctl(self.endpoint, "status")
        return s if s and s.get("state") == "serving" else None

    def start_trainer(self, config: Path, rdzv: str, run_id: str) -> None:
        """`torchrun --nnodes 2 --node-rank H --rdzv-backend c10d ...` (gloo on CPU); a failure restarts the world."""
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(HOSTS), "--node-rank", str(self.rank),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", run_id, "--nproc-per-node", "1",
               "--max-restarts", "3", "-m", "dfpipe", "trainer", "-c", str(config)]
        for o in self.overrides:
            cmd += ["--set", o]
        self.trainer = Torchrun(f"torchrun-h{self.rank}", cmd, config.parent)

    def trainer_rank_pid(self) -> int:
        """The trainer rank torchrun started on this host (its agent's one child)."""
        kids = wait_for(lambda: _children(self.trainer.pid), 60, f"host {self.rank}'s trainer rank")
        assert len(kids) == 1, kids
        return kids[0]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    """Two hosts' target servers, serving for the whole module (as they would: long-lived)."""
    tmp = tmp_path_factory.mktemp("hosts")
    # two epochs: every host's shard crosses an epoch boundary (more epochs only repeat it)
    config = write_config(tmp, samples=120, train={"epochs": 2, "checkpoint_every": 3},
                          cluster={"num_hosts": HOSTS})
    hosts = [Host(h, config, tmp) for h in range(HOSTS)]
    try:
        for host in hosts:
            host.start_target()
        for host in hosts:
            wait_for(host.serving, 180, f"host {host.rank}'s target serving")
        yield hosts
    finally:
        for host in hosts:
            if host.target is not None:
                host.target.stop()


@pytest.fixture
def cluster(servers: list[Host], tmp_path: Path):
    """This test's run: the servers' config with its own out_dir and trainer control socket."""
    cfg = load(servers[0].config)
    cfg["train"]["out_dir"] = str(tmp_path / "run")
    sock_dir = cfg["service"]["trainer_endpoint"].removeprefix("ipc://").rsplit("/", 1)[0]
    cfg["service"]["trainer_endpoint"] = f"ipc://{sock_dir}/trainer-{uuid.uuid4().hex[:8]}.sock"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    try:
        yield config, servers
    finally:
        for host in servers:
            if host.trainer is not None:
                host.trainer.stop()
                host.trainer = None


def _train(config: Path, hosts: list[Host]) -> None:
    rdzv, run_id = f"127.0.0.1:{_free_port()}", uuid.uuid4().hex[:8]
    for host in hosts:
        host.start_trainer(config, rdzv, run_id)


def _finish(hosts: list[Host]) -> None:
    for host in hosts:
        assert host.trainer.wait(300) == 0, host.trainer.log()


def _check_hosts(config: Path, hosts: list[Host]) -> dict:
    """Exactly once in total, and per host: each host's shard of every epoch, all of it."""
    info = assert_exactly_once(config)
    statuses = [ctl(h.endpoint, "status") for h in hosts]
    sizes = statuses[0]["epoch_sizes"]
    assert info["batches"] == sum(sizes)
    shard_sizes = [sum(s["cluster"]["shard_sizes"]) for s in statuses]
    assert [s["cluster"]["host_rank"] for s in statuses] == list(range(HOSTS))
    assert sum(shard_sizes) == sum(sizes) and all(shard_sizes), shard_sizes
    assert info["cluster"] == accounting(shard_sizes, sizes), "the checkpoint counts each host's shard, all of it"
    return info


def test_two_hosts_train_every_sample_of_every_epoch_once_each_host_its_shard(cluster) -> None:
    config, hosts = cluster
    before = [ctl(h.endpoint, "status") for h in hosts]
    _train(config, hosts)
    _finish(hosts)
    _check_hosts(config, hosts)
    for host, was in zip(hosts, before):
        s = ctl(host.endpoint, "status")
        shard = sum(s["cluster"]["shard_sizes"])
        # each server delivered its shard once, computed nothing twice, and no HELLO strayed
        assert s["batches"]["acked"] - was["batches"]["acked"] == shard, s["batches"]
        assert s["batches"]["recomputed"] == was["batches"]["recomputed"], s["batches"]
        assert s["finished"] == was["finished"] + 1 and s["refused"] == was["refused"], s
    logs = "".join(h.trainer.log(tail=10_000) for h in hosts)
    assert "trainer[1]" in logs and "trainer[0] INFO exported drafter" in logs


def test_a_killed_trainer_rank_restarts_the_world_from_the_checkpoint_exactly_once(cluster) -> None:
    config, hosts = cluster
    cfg = load(config)
    checkpoints = Path(cfg["train"]["out_dir"]) / "checkpoints"
    _train(config, hosts)
    wait_for(lambda: any(checkpoints.glob("step-*")), 120, "a checkpoint", interval=0.05)
    os.kill(hosts[1].trainer_rank_pid(), signal.SIGKILL)   # the rank, not its torchrun agent
    # the restarted world's rank 0 reports each host's progress and the total (`ctl trainer status`)
    status = wait_for(lambda: (s := ctl(cfg["service"]["trainer_endpoint"], "status")) and s.get("step", 0) > 0
                      and "resuming from" in "".join(h.trainer.log(tail=10_000) for h in hosts)
                      and all(h["batches_trained"] > 0 for h in s["cluster"]["hosts"]) and s, 120,
                      "the restarted world training on both hosts", interval=0.05)
    assert [h["host"] for h in status["cluster"]["hosts"]] == [0, 1]
    assert status["cluster"]["total"]["batches_planned"] == status["batches_planned"]
    per_host = status["cluster"]["hosts"]
    assert status["cluster"]["total"]["batches_trained"] == sum(h["batches_trained"] for h in per_host)
    _finish(hosts)
    _check_hosts(config, hosts)
    logs = "".join(h.trainer.log(tail=10_000) for h in hosts)
    assert "exitcode: -9" in logs, "host 1's rank was killed mid-run"
    for host in hosts:
        assert ctl(host.endpoint, "status")["model_loads"] == 1, "every target server kept its model"


def test_a_killed_target_server_is_restarted_and_its_host_resumes_exactly_once(cluster) -> None:
    config, hosts = cluster
    acked = ctl(hosts[1].endpoint, "status")["batches"]["acked"]   # the servers outlive every test's trainer
    _train(config, hosts)
    wait_for(lambda: (s := ctl(hosts[1].endpoint, "status")) and s["batches"]["acked"] >= acked + 4 and s, 120,
             "host 1 delivering", interval=0.05)
    hosts[1].target.kill9()
    time.sleep(1.0)   # host 0 trains on (and its shard may run dry: it waits), host 1's ranks wait
    hosts[1].start_target()
    _finish(hosts)
    _check_hosts(config, hosts)
    log = hosts[1].trainer.log(tail=10_000)
    assert "waiting" in log or "new target server rings" in log, log



def test_a_trainer_at_another_hosts_server_is_refused(cluster) -> None:
    config, hosts = cluster
    # HELLO holding host 0's batches, to host 1's server: refused, and the session is not touched
    chan = DealerChannel(hosts[1].endpoint)
    try:
        pid, start = self_identity()
        chan.send(Hello(rid=next_rid(), job="stray", secret=new_session_secret(), rank=0, world=1, pid=pid,
                        start_time=start, have=SeqSet([0]), epochs=1, credit=2, heldout=False))
        reply = wait_for(lambda: chan.recv(timeout_s=0.5), 30, "the server's answer")
    finally:
        chan.close()
    assert isinstance(reply, Reply) and not reply.ok and "outside host 1's shard of 2 hosts" in reply.error, reply
    assert ctl(hosts[1].endpoint, "status")["refused"].get("out_of_shard", 0) >= 1
    # a trainer configured as host 0 but pointed at host 1's server stops before training (exit 6)
    trainer = Service("trainer", config, config.parent,
                      overrides=["cluster.host_rank=0", f"service.target_endpoint={hosts[1].endpoint}"])
    assert trainer.wait(120) == 6, trainer.log()
    assert "serves host 1 of 2, this trainer rank is on host 0 of 2" in trainer.log(tail=10_000)
    assert not (Path(load(config)["train"]["out_dir"]) / "checkpoints").exists(), "nothing trained, nothing saved"
