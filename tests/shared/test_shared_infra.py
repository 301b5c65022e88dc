"""shared/: config parsing, subjects and keys, and the store against a real Redis."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest
import redis.asyncio as redis

from shared import keys, subjects
from shared.bus import Bus
from shared.config import ConfigError, load_cluster, parse_cluster
from shared.messages.estimator import (
    ROUTE_REPLY_DECODER,
    ROUTE_REQUEST_DECODER,
    RouteReply,
    RouteRequest,
)
from shared.store import _WRITE_SNAPSHOT_SHA, Store
from tests.support.builders import worker_info


@asynccontextmanager
async def connected_store(redis_url: str, namespace: str) -> AsyncIterator[Store]:
    """A Store in `namespace`, connected for the block."""
    store = Store(redis_url, namespace)
    await store.connect()
    try:
        yield store
    finally:
        await store.close()


def test_shipped_cluster_files_parse(repo_root) -> None:  # type: ignore[no-untyped-def]
    local = load_cluster(repo_root / "configs/local.toml", environ={})
    assert local.gateway.port == 8000
    assert set(local.models) == {"smollm2-135m", "smollm2-medium", "smollm2-small"}
    assert local.candidates("auto") == ["smollm2-135m", "smollm2-medium", "smollm2-small"]
    tiny = load_cluster(
        repo_root / "configs/tiny.toml", environ={"BATON_PORT": "9000", "BATON_NAMESPACE": "x"}
    )
    assert tiny.gateway.port == 9000 and tiny.namespace == "x"
    for path in sorted((repo_root / "configs").glob("*.toml")):  # every shipped file is valid
        cluster = load_cluster(path, environ={})
        ids = [iid for inst in cluster.instances for iid in cluster.replica_ids(inst)]
        assert all(subjects.is_token(i) for i in ids) and len(set(ids)) == len(ids), path


def test_replica_ids_are_subject_tokens_and_never_shared() -> None:
    assert subjects.as_token("qwen2.5-7b-0") == "qwen2-5-7b-0"
    assert not subjects.is_token("baton\n") and not subjects.is_token("")  # fullmatch
    assert subjects.as_token("a b/c*d>e_f") == "a-b-c-d-e_f" and subjects.as_token("") == "-"
    models = '[models."m.1"]\n[models.m-1]\n'
    one = parse_cluster(models + '[[instances]]\nmodel = "m.1"\nreplicas = 2\n', environ={})
    assert one.replica_ids(one.instances[0]) == ["m-1-0", "m-1-1"]
    with pytest.raises(ConfigError, match=re.escape("namespace 'a.b' may hold only letters")):
        parse_cluster("", environ={"BATON_NAMESPACE": "a.b"})
    token_preset = '[presets."r2r.v2"]\nmodels = ["m.1", "m-1"]\ntoken_policy = "r2r"\n'
    with pytest.raises(ConfigError, match=re.escape("token-level preset 'r2r.v2' may hold only")):
        parse_cluster(models + token_preset, environ={})
    clash = "'m.1' and 'm-1' give two replicas the instance id 'm-1-0'"
    with pytest.raises(ConfigError, match=re.escape(clash)):
        parse_cluster(
            models + '[[instances]]\nmodel = "m.1"\n[[instances]]\nmodel = "m-1"\n', environ={}
        )


A_INSTANCE = '[models.a]\n[[instances]]\nmodel = "a"\n'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[gateway]\nbogus = 1\n", "unknown field `bogus`"),
        ('[models.a]\n[presets.p]\nmodels = ["nope"]\n', "unknown model 'nope'"),
        ('[gateway]\nport = "x"\n', "Expected `int`"),
        ("[relay]\npeer_timeout_s = 40.0\n", "origin_wait_s above it"),
        ("[relay]\nguest_idle_s = 0\n", "guest_idle_s must be > 0"),
        (
            '[models.a]\n[models.b]\n[presets.p]\nmodels = ["a", "b"]\ntoken_policy = "r2d2"\n',
            "unknown token_policy 'r2d2': use one of citer, ",
        ),
        (
            '[models.a]\n[presets.p]\nmodels = ["a"]\npolicy = "routebalance"\n'
            "routebalance_weights = [0.5, 0.6, 0.1]\n",
            "routebalance_weights must be 3",
        ),
        ("[estimator]\nroutebalance_batch_size = -1\n", "routebalance_batch_size must be >= 0"),
        ('[models.a]\ndtype = "fp8"\n', "dtype"),
        ('[models.a]\nweight_dtype = "int4"\n', "weight_dtype"),
        # the engine's limits, checked when the file is read (not by each worker after loading)
        (
            A_INSTANCE + "[instances.scheduler]\nnum_kv_blocks = 8\n",
            "max_model_len=2048 needs more KV than num_kv_blocks=8",
        ),
        (
            A_INSTANCE + "[instances.scheduler]\nmax_num_seqs = 0\n",
            "scheduler limits must be positive, got max_num_seqs=0",
        ),
        (A_INSTANCE + "threads = 0\n", "threads must be >= 1"),
        # the limits live in [instances.scheduler]: flat ones and typos there are named
        (A_INSTANCE + "max_num_seqs = 4\n", r"move max_num_seqs into \[instances.scheduler\]"),
        (
            A_INSTANCE + "[instances.scheduler]\nmax_num_seq = 4\n",
            r"unknown \[instances.scheduler\] key 'max_num_seq'",
        ),
    ],
)
def test_cluster_errors_are_clear(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_cluster(text, environ={})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[gateway]\nmax_in_flight = 0\n", "max_in_flight must be > 0"),
        ("[gateway]\nmax_in_flight = -1\n", "max_in_flight must be > 0"),
        ("[worker]\nheartbeat_interval_s = -1.0\n", "heartbeat_interval_s must be > 0"),
        (
            "[worker]\nheartbeat_interval_s = 1.0\nheartbeat_ttl_s = 0.5\n",
            "must be longer than heartbeat_interval_s",
        ),
        ("[worker]\ndrain_timeout_s = -1.0\n", "drain_timeout_s must be >= 0"),
        ("[estimator]\nsnapshot_max_age_s = nan\n", "snapshot_max_age_s must be > 0"),
        ("[models.a]\nprice_input_per_mtok = -1.0\n", "prices must be >= 0"),
        ('redis_url = "redis://127.0.0.1:notaport/0"\n', "redis_url"),
        ('nats_url = "nats://127.0.0.1:99999"\n', "nats_url"),
        ('[models.a]\ndevice = "gpu9"\n', "not a torch device"),
        (
            '[models.a]\n[[instances]]\nmodel = "a"\n[instances.scheduler]\nmax_model_len = -2048\n',
            "must be positive",
        ),
    ],
)
def test_limits_out_of_range_are_refused_when_the_file_is_read(text: str, message: str) -> None:
    """Each of these, let through, starts a cluster that then fails every request
    (429s), flaps (registrations expiring before renewal) or spins (a heartbeat loop at
    0 s), or ends the launcher in a traceback."""
    with pytest.raises(ConfigError, match=message):
        parse_cluster(text, environ={})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # msgspec names a table's entry `[...]`: the error names the model or preset
        ('[models.a]\n[models.b]\ndtype = "fp8"\n', r"\[models\.b\]: Invalid enum value 'fp8'"),
        ('[models."q-0.6b"]\ndevice = "tpu"\n', r'\[models\."q-0\.6b"\]: device .tpu.'),
        ('[models.a]\n[presets.p]\nmodels = ["a"]\npolicy = "x"\n', r"\[presets\.p\]: .*policy"),
        # the sim engine's settings are checked when the file is read, not by a worker
        ('[models.a]\n[models.a.sim]\nclokc = "wall"\n', "unknown \\[sim\\] setting 'clokc'"),
        ('redis_url = "notaurl"\n', "redis_url 'notaurl': use a URL with the scheme redis://"),
        ('nats_url = "nats://"\n', "nats_url 'nats://': no host"),
    ],
)
def test_a_bad_entry_is_named(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_cluster(text, environ={})


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        # a value the environment set fails the file's own check, which says so
        ({"BATON_DTYPE": "bogus"}, r"Invalid enum value 'bogus' .*environment sets BATON_DTYPE\)"),
        ({"BATON_WEIGHT_DTYPE": "x"}, r"'x' .*\(the environment sets BATON_WEIGHT_DTYPE\)"),
        ({"BATON_DEVICE": "tpu"}, r"not a torch device.*environment sets BATON_DEVICE\)"),
        ({"BATON_THREADS": "0"}, r"threads must be >= 1 .*environment sets BATON_THREADS\)"),
        ({"BATON_NATS_URL": "notaurl"}, r"use a URL with the scheme .*sets BATON_NATS_URL\)"),
        ({"BATON_REDIS_URL": "unix://tmp/r.sock"}, "by its absolute path"),
        # a password is not printed
        ({"BATON_REDIS_URL": "redis://:s3cret@h:x/0"}, r"'redis://:\*\*\*@h:x/0': Port"),
        # a combination: every variable set is named
        (
            {"BATON_DTYPE": "bfloat16", "BATON_WEIGHT_DTYPE": "float16"},
            r"needs dtype float32 .*environment sets BATON_DTYPE, BATON_WEIGHT_DTYPE\)",
        ),
        ({"BATON_LOG_LEVEL": "loud"}, "BATON_LOG_LEVEL='loud': use debug, info"),
        ({"BATON_PORT": "eighty"}, "BATON_PORT must be an integer"),
    ],
)
def test_a_bad_environment_value_is_named_by_its_variable(
    environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_cluster(A_INSTANCE, environ=environ)
    ok = parse_cluster("", environ={"BATON_REDIS_URL": "unix:///tmp/r.sock?db=0"})
    assert ok.redis_url.startswith("unix://")
    for level in ("DEBUG", "warn", "critical"):  # what stdlib logging takes
        parse_cluster("", environ={"BATON_LOG_LEVEL": level})


def test_the_sim_settings_are_the_sim_engines_own_less_the_instance_limits() -> None:
    from dataclasses import fields

    from services.worker.engine.sim import SimEngineConfig
    from shared.config import SIM_SETTINGS, InstanceConfig

    limits = set(InstanceConfig.__struct_fields__)
    assert {f.name for f in fields(SimEngineConfig)} - limits == SIM_SETTINGS


def test_dtype_environment_overrides_every_model() -> None:
    text = '[models.a]\ndtype = "float32"\nweight_dtype = "same"\n[models.b]\n'
    cluster = parse_cluster(text, environ={})
    assert (cluster.models["a"].dtype, cluster.models["a"].weight_dtype) == ("float32", "same")
    assert cluster.models["b"].weight_dtype == "auto"
    env = {"BATON_DTYPE": "float32", "BATON_WEIGHT_DTYPE": "float16"}
    cluster = parse_cluster(text, environ=env)
    for model in cluster.models.values():
        assert (model.dtype, model.weight_dtype) == ("float32", "float16")
    # what every worker would refuse is refused when the file is read
    with pytest.raises(ConfigError, match="needs dtype float32 on the CPU"):
        parse_cluster(text, environ={**env, "BATON_DTYPE": "bfloat16"})
    with pytest.raises(ConfigError, match="needs dtype float32 on the CPU"):
        parse_cluster('[models.a]\nweight_dtype = "float16"\ndevice = "cuda"\n', environ={})


def test_subjects_and_keys_are_namespaced() -> None:
    assert subjects.worker_inbox("ns", "w-1") == "ns.worker.w-1.in"
    assert keys.snapshot("ns", "w-1") == "ns:snapshot:w-1"
    with pytest.raises(ValueError):
        subjects.worker_inbox("ns", "a.b")  # a dot would split the subject token


async def test_snapshot_write_is_atomic_and_staleness_is_visible(redis_url: str) -> None:
    async with connected_store(redis_url, "infra") as store:
        stop = asyncio.Event()
        torn = 0

        async def reader() -> int:
            nonlocal torn
            reads = 0
            while not stop.is_set():
                blob = (await store.read_snapshots(["w"]))["w"]
                if blob is not None:
                    reads += 1
                    torn += int(blob.data) != blob.version  # payload must belong to its version
                await asyncio.sleep(0)
            return reads

        task = asyncio.create_task(reader())
        for version in range(1, 300):
            await store.write_snapshot(
                "w", version, str(version).encode(), ttl_s=5, samples=[b"s"], max_samples=50
            )
        stop.set()
        assert await task > 0 and torn == 0
        blob = (await store.read_snapshots(["w"]))["w"]
        assert blob is not None and blob.version == 299 and not blob.is_stale(1.0)
        assert blob.is_stale(1.0, now_s=time.time() + 2)
        assert len(await store.read_samples("w")) == 50  # capped
        # A key left by another layout (the earlier hash) reads as no snapshot, and
        # the next write replaces it.
        await store.redis.delete(keys.snapshot("infra", "old"))
        await store.redis.hset(keys.snapshot("infra", "old"), mapping={"version": 1})
        both = await store.read_snapshots(["old", "w"])
        assert both["old"] is None and both["w"] is not None
        await store.write_snapshot("old", 2, b"x", ttl_s=5)
        again = (await store.read_snapshots(["old"]))["old"]
        assert again is not None and (again.version, again.data) == (2, b"x")


async def test_snapshot_reads_survive_a_dropped_connection_and_a_cancelled_read(
    redis_url: str,
) -> None:
    """The hot-read connection (redis_lane.Lane): a connection the server dropped is
    reopened for the same call; a read cancelled between its request and the reply
    closes the connection, so the next read never takes the stale reply."""
    async with connected_store(redis_url, "hot") as store:
        for iid, version in (("a", 1), ("b", 2)):
            await store.write_snapshot(iid, version, iid.encode(), ttl_s=30)
        blob = (await store.read_snapshots(["a"]))["a"]
        assert blob is not None and blob.data == b"a"
        # the server closes every other client connection (the hot one among them)
        await store.redis.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        blob = (await store.read_snapshots(["a"]))["a"]
        assert blob is not None and (blob.version, blob.data) == (1, b"a")
        # the server holds every command for 300 ms: the read of "a" is sent, then
        # cancelled before its reply comes; the next call reads "b" and gets "b"
        await store.redis.execute_command("CLIENT", "PAUSE", "300", "ALL")
        task = asyncio.create_task(store.read_snapshots(["a"]))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not store.hot.is_connected  # cancelled mid-exchange: closed
        both = await store.read_snapshots(["b", "a"])
        assert [(k, v.data if v else None) for k, v in both.items()] == [("b", b"b"), ("a", b"a")]
        # the combined read: snapshots and ledger hashes (RESP2 pairs made a dict)
        await store.redis.hset(keys.ledger("hot", "b"), mapping={"r1": b"x", "r2": b"y"})
        snaps, ledgers = await store.read_snapshots_and_ledgers(["a", "b"])
        assert snaps["b"] is not None and snaps["b"].data == b"b"
        assert ledgers == {"a": {}, "b": {b"r1": b"x", b"r2": b"y"}}
        # a server that does not answer within the store's socket timeout (one deadline
        # over the exchange here): the read fails and closes the connection; the next
        # one, after the pause, gets its own reply
        store.hot.timeout_s = 0.1
        await store.redis.execute_command("CLIENT", "PAUSE", "400", "ALL")
        with pytest.raises(redis.TimeoutError, match="no reply from Redis"):
            await store.read_snapshots(["a"])
        assert not store.hot.is_connected
        store.hot.timeout_s = 5.0  # this one waits out the rest of the pause
        both = await store.read_snapshots(["b", "a"])
        assert [(k, v.data if v else None) for k, v in both.items()] == [("b", b"b"), ("a", b"a")]


async def test_an_error_reply_leaves_a_lane_in_step(redis_url: str) -> None:
    """redis_lane.Lane: an error reply read whole keeps the connection; one that leaves
    replies of its exchange unread closes it, so no later call reads them."""
    async with connected_store(redis_url, "lane") as store:
        lane = store.hot
        await store.redis.set("lane:str", b"v")
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            await lane.command("HGETALL", "lane:str")
        assert lane.is_connected
        assert await lane.command("GET", "lane:str") == b"v"
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            await lane.execute(("mixed",), [("HGETALL", "lane:str"), ("GET", "lane:str")])
        assert not lane.is_connected
        assert await lane.command("GET", "lane:str") == b"v"


async def test_a_snapshot_write_appends_every_sample_in_order_and_survives_a_script_flush(
    redis_url: str,
) -> None:
    async with connected_store(redis_url, "samples") as store:
        many = [str(i).encode() for i in range(2_500)]  # over the script's RPUSH slice
        await store.write_snapshot("w", 1, b"a", ttl_s=5, samples=many, max_samples=10_000)
        assert await store.redis.lrange(keys.batch_samples("samples", "w"), 0, -1) == many
        # Redis lost its script cache (a restart): the next write loads it again
        await store.redis.script_flush()
        await store.write_snapshot("w", 2, b"b", ttl_s=5, samples=[b"x", b"y"], max_samples=3)
        assert await store.redis.lrange(keys.batch_samples("samples", "w"), 0, -1) == [
            b"2499",
            b"x",
            b"y",
        ]
        blob = (await store.read_snapshots(["w"]))["w"]
        assert blob is not None and (blob.version, blob.data) == (2, b"b")
        ttl_ms = await store.redis.pttl(keys.snapshot("samples", "w"))
        assert 0 < ttl_ms <= 5_000
        with pytest.raises(ValueError, match="max_samples"):
            await store.write_snapshot("w", 3, b"c", ttl_s=5, max_samples=0)


async def test_registry_expires_without_heartbeat(redis_url: str) -> None:
    async with connected_store(redis_url, "reg") as store:
        info = worker_info("w", namespace="reg", max_model_len=1, max_num_seqs=1)
        await store.register(info, ttl_s=1.0)  # (room for a stalled loop before the read)
        assert [w.instance_id for w in await store.live_workers()] == ["w"]
        await asyncio.sleep(1.3)
        assert await store.live_workers() == []


async def test_bus_request_reply_and_bad_messages(nats_url: str) -> None:
    bus = Bus(nats_url, "t")
    await bus.connect()
    try:

        async def answer(req: RouteRequest) -> RouteReply:
            return RouteReply(request_id=req.request_id, instance_id="i")

        await bus.serve("infra.route", ROUTE_REQUEST_DECODER, answer)
        await bus.nc.publish(
            "infra.route", b"\x00garbage"
        )  # logged and dropped, the server keeps answering
        req = RouteRequest(request_id="r", model="m", num_prompt_tokens=1, max_tokens=1)
        reply = await bus.request("infra.route", req, ROUTE_REPLY_DECODER, timeout_s=2)
        assert reply == RouteReply(request_id="r", instance_id="i")
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(reply), type=RouteReply) == reply
    finally:
        await bus.close()


async def test_a_reply_that_waits_on_a_future_leaves_the_subscription_free(
    nats_url: str,
) -> None:
    """The first request's answer waits until the second one has arrived: with the reply
    behind a future, the subscription takes the second request meanwhile (awaiting in
    the handler, nats-py would hold it back and both would time out)."""
    bus = Bus(nats_url, "t")
    await bus.connect()
    held: list[tuple[RouteRequest, asyncio.Future[msgspec.Struct]]] = []
    try:

        async def answer(req: RouteRequest) -> asyncio.Future[msgspec.Struct]:
            fut: asyncio.Future[msgspec.Struct] = asyncio.get_running_loop().create_future()
            held.append((req, fut))
            if len(held) == 2:  # both arrived: answer both
                for r, f in held:
                    f.set_result(RouteReply(request_id=r.request_id, instance_id="i"))
            return fut

        await bus.serve("infra.later", ROUTE_REQUEST_DECODER, answer)
        reqs = [
            RouteRequest(request_id=rid, model="m", num_prompt_tokens=1, max_tokens=1)
            for rid in ("a", "b")
        ]
        replies = await asyncio.gather(
            *(bus.request("infra.later", r, ROUTE_REPLY_DECODER, timeout_s=5) for r in reqs)
        )
        assert [r.request_id for r in replies] == ["a", "b"]
    finally:
        await bus.close()


def test_retry_log_keeps_an_outage_to_a_few_lines() -> None:
    """RetryLog: the first failure of a stretch at once, then one line per every_s with
    the count left out, one `_recovered` line on the first success, nothing after."""
    from structlog.testing import capture_logs

    from shared.logging import RetryLog, get_logger

    with capture_logs() as lines:
        failures = RetryLog(get_logger(component="t"), "refresh_failed", every_s=0.2)
        failures.ok()  # no stretch yet: nothing
        for _ in range(50):  # a loop retrying every few ms
            failures.failed(error="down")
        time.sleep(0.25)
        failures.failed(error="down")
        failures.ok()
        failures.ok()
        failures.failed(error="again")  # a new stretch is logged at once
    events = [(e["event"], e.get("failures"), e.get("left_out")) for e in lines]
    assert events == [
        ("refresh_failed", 1, None),
        ("refresh_failed", 51, 49),
        ("refresh_recovered", 51, None),
        ("refresh_failed", 1, None),
    ]
    assert lines[0]["log_level"] == "warning" and lines[2]["log_level"] == "info"
    assert lines[2]["lasted_s"] >= 0.25


def test_registry_epoch_keeps_workers_only_after_the_store_lost_its_data() -> None:
    from shared.messages.registry import RegistryEpoch

    view = RegistryEpoch(ttl_s=3.0)
    # (their heartbeat_at_s is the worker's clock: never compared with the reader's)
    a, b = worker_info("a"), worker_info("b")
    live = view.carry({}, [a, b], "e1", 100.0)  # the first read: no epoch before it
    assert set(live) == {"a", "b"}
    # the same epoch: a worker the read lacks deregistered or expired, gone at once
    assert view.carry(live, [a], "e1", 100.1) == {"a": a}
    # the store lost its data (no epoch yet): every worker known is kept as last read,
    # then a new epoch within the window changes nothing
    kept = view.carry(live, [], None, 100.2)
    assert kept == {"a": a, "b": b}
    back = view.carry(kept, [a], "e2", 101.0)  # a registered again, b not yet
    assert back == {"a": a, "b": b}
    # b never came back: gone when the window ends (3 s after the change was seen)
    assert view.carry(back, [a], "e2", 103.3) == {"a": a}
    # past the window, a missing worker is gone at once again
    assert view.carry({"a": a}, [], "e2", 104.0) == {}


def test_default_ids_on_a_dotted_host_name_are_subject_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EC2-style host names hold dots; the gateway's and a worker's default ids (which
    name their NATS inboxes) must not."""
    from services.gateway.config import GatewayServiceConfig
    from services.worker.config import default_instance_id

    monkeypatch.setattr(socket, "gethostname", lambda: "ip-10-0-0-7.ec2.internal")
    monkeypatch.delenv("BATON_GATEWAY_ID", raising=False)
    gid = GatewayServiceConfig.from_cluster(parse_cluster("", environ={})).gateway_id
    iid = default_instance_id("qwen2.5-7b")
    assert gid.startswith("gw-ip-10-0-0-7-ec2-internal-") and subjects.is_token(gid)
    assert iid.startswith("qwen2-5-7b-ip-10-0-0-7-ec2-internal-") and subjects.is_token(iid)
    subjects.gateway_inbox("baton", gid), subjects.worker_inbox("baton", iid)  # no ValueError


def test_explicit_ids_that_are_not_tokens_are_config_errors() -> None:
    """Given ids are not rewritten (they name a deployment's subjects and keys): a bad
    one is a clear config error, so `python -m services.<name>` exits 2 with it."""
    from services.gateway.config import GatewayServiceConfig
    from services.worker.config import WorkerServiceConfig

    cluster = parse_cluster('[models.m]\n[[instances]]\nmodel = "m"\n', environ={})
    with pytest.raises(ConfigError, match=re.escape("instance id 'w.1' may hold only")):
        WorkerServiceConfig.from_cluster(cluster, "m", "w.1")
    with pytest.raises(ConfigError, match=re.escape("gateway id 'gw 1' may hold only")):
        GatewayServiceConfig.from_cluster(cluster, "gw 1")
    assert WorkerServiceConfig.from_cluster(cluster, "m", "w-1").instance_id == "w-1"
    assert GatewayServiceConfig.from_cluster(cluster, "gw_1").gateway_id == "gw_1"


def test_compose_healthcheck_finds_this_hosts_worker_by_its_default_id() -> None:
    from services.worker.config import default_instance_id
    from services.worker.health import on_host

    host = socket.gethostname()
    assert on_host(default_instance_id("qwen2.5-7b"), host)
    assert on_host("qwen2-5-7b-ip-10-0-0-7-ec2-internal-41", "ip-10-0-0-7.ec2.internal")
    assert not on_host("ma-1", "a") and not on_host("m-other-1", "a")


async def test_snapshot_writes_load_their_script_on_a_fresh_server(redis_url: str) -> None:
    """The write goes by EVALSHA; a server without the script (new or restarted) gets
    NOSCRIPT, and the write is made by EVAL, which caches it."""
    async with connected_store(redis_url, "evalsha") as store:
        await store.redis.script_flush()
        await store.write_snapshot("w", 7, b"snap", ttl_s=5, samples=[b"s1", b"s2"])
        assert await store.redis.script_exists(_WRITE_SNAPSHOT_SHA) == [True]
        blob = (await store.read_snapshots(["w"]))["w"]
        assert blob is not None and (blob.version, blob.data) == (7, b"snap")
        samples = await store.redis.lrange(keys.batch_samples("evalsha", "w"), 0, -1)
        assert samples == [b"s1", b"s2"]
