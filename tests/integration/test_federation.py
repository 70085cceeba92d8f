"""The running system end to end: a real server process (uvicorn), a real broker (a private Mosquitto where
this machine has one, the embedded amqtt otherwise) and real device processes talking HTTP and MQTT.

A federation of device processes ends with the in-process simulator's models (same config and seed), the
server never receives a personal block, and a device killed mid-run and restarted changes nothing."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fedkit import BASE, assert_simulator_models, device_log, ended
from pgkit import fresh_schema

from edge_runtime.data import load_local_data
from edge_runtime.fleet import Federation, free_port, start_server
from pfl_edge.algorithms import get_algorithm
from pfl_edge.codec import decode
from pfl_edge.protocol import API_PREFIX
from pfl_edge.sim import SimConfig, simulate
from server.fedmodel import fed_model

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)


def _mosquitto(conf: Path, port: int) -> subprocess.Popen[bytes]:
    """A private Mosquitto (no persistence: a restart forgets every retained message and session)."""
    assert MOSQUITTO is not None
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    return proc


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private Mosquitto on a free port, or 'embedded' where the machine has none."""
    if MOSQUITTO is None:
        yield "embedded"
        return
    port = free_port()
    proc = _mosquitto(tmp_path_factory.mktemp("mosquitto") / "m.conf", port)
    yield f"mqtt://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def postgres_url() -> Iterator[str | None]:
    """A PostgreSQL URL whose search_path is a fresh schema of database ``test`` (dropped afterwards), or None
    where no PostgreSQL answers on 127.0.0.1:5432."""
    with fresh_schema("pfl_it") as url:
        yield url


def _run(root: Path, config: dict[str, Any], profiles: list[str], *, broker: str, database_url: str | None = None,
         kill_and_restart: int | None = None, restart_server_at: int | None = None,
         late: int | None = None, extra: dict[int, list[str]] | None = None,
         at_round: tuple[int, Any] | None = None, timeout_s: float = 600) -> Federation:
    """Run a federation to its end (``timeout_s``: a generous bound; a device may wait minutes for a program
    export on a loaded machine). ``late``: device ``late`` (the last) enrols only once round 1 has closed; round
    1 opens without it."""
    fed = start_server(root, broker_url=broker, database_url=database_url)
    try:
        # a generous deadline: no test here waits for one to pass, and a slow device must not miss its round
        fed.create(f"t{int(time.time() * 1000) % 10**9}", config, deadline_s=600.0,
                   **({"min_devices": len(profiles) - 1} if late is not None else {}))
        for i, p in enumerate(profiles):
            if i != late:
                fed.start_device(i, p, extra=(extra or {}).get(i, ["--training-backend", "torch"]))
        joined = late is None
        restarted = server_restarted = False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = fed.info()
            if not joined and info["round"] >= 1:
                assert late is not None
                _enrol_late(fed, late, profiles[late], config)
                fed.start_device(late, profiles[late], extra=["--training-backend", "torch"])
                joined = True
            if kill_and_restart is not None and not restarted and info["round"] >= 2:
                # a device killed without warning (no clean disconnect: its last will fires), then restarted
                fed.devices[kill_and_restart].kill()
                fed.devices[kill_and_restart].wait()
                fed.start_device(kill_and_restart, profiles[kill_and_restart],  # as it was started
                                 extra=(extra or {}).get(kill_and_restart, ["--training-backend", "torch"]))
                restarted = True
            if at_round is not None and info["round"] >= at_round[0]:
                at_round[1]()
                at_round = None
            if restart_server_at is not None and not server_restarted and info["round"] >= restart_server_at:
                fed.restart_server()
                server_restarted = True
                continue
            if ended(fed, root, info):
                break
            time.sleep(0.3)
        else:
            raise AssertionError("federation did not finish: " + device_log(root, 0)
                                 + (root / "server.log").read_text())
        assert all(p.returncode == 0 for p in fed.devices)
        return fed
    except BaseException:
        fed.close()
        raise


def _enrol_late(fed: Federation, i: int, profile: str, config: dict[str, Any]) -> None:
    """Enrol device i now, as its agent would, into its state dir; for DisPFL also send its initial sparse model
    (the agent computes the same one from the same seeds, and its own upload is then an idempotent repeat). So
    the server counts it from the next round, however long its process takes to start."""
    import hashlib
    import json

    from edge_runtime.trainer import DeviceTrainer, device_clients
    from edge_runtime.training import TorchBackend
    from pfl_edge.codec import encode
    from pfl_edge.federation import init_state, model_id

    r = fed.http.post(f"{API_PREFIX}/devices", json={"federation": fed.fed, "enrol_secret": fed.secret,
                                                    "profile": profile, "name": f"device-{i:02d}", "index": i})
    assert r.status_code == 201, r.text
    enr = r.json()
    state = fed.root / "devices" / f"device-{i:02d}"
    state.mkdir(parents=True, exist_ok=True)
    (state / "enrolment.json").write_text(json.dumps(enr))
    cfg = SimConfig.from_dict(config)
    if cfg.algorithm == "dispfl":
        data = load_local_data(cfg, i)
        algo = get_algorithm(cfg, data.model)
        dev = device_clients(cfg, DeviceTrainer(data, TorchBackend(data.model)), i)
        up = algo.device_upload(algo.device_init(dev, init_state(cfg, data.spec), enr["density"]))
        payload = encode(up.tensors, model_id=model_id(data.spec), round=0, masks=up.masks)
        digest = hashlib.sha256(payload).hexdigest()
        auth = {"Authorization": f"Bearer {enr['token']}"}
        assert fed.http.put(f"{API_PREFIX}/blobs/{digest}", content=payload, headers=auth).status_code < 300
        r = fed.http.post(f"{API_PREFIX}/rounds/0/updates", json={"digest": digest, "n_samples": data.n_train},
                          headers=auth)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("db", ["sqlite", "postgresql"])
def test_fedper_devices_end_with_the_simulators_models(tmp_path: Path, broker: str, db: str,
                                                       postgres_url: str | None) -> None:
    database_url = None
    if db == "postgresql":
        database_url = postgres_url
        if database_url is None:
            pytest.skip("no PostgreSQL on 127.0.0.1:5432")
    cfg = SimConfig(algorithm="fedper", clients=3, kp=2, **BASE)
    fed = _run(tmp_path / "run", cfg.to_dict(), ["phone-mid", "raspberry-pi-4", "jetson-nano"], broker=broker,
               database_url=database_url)
    try:
        metrics = fed.get(f"{API_PREFIX}/federations/{fed.fed}/metrics")
        blobs = sorted((tmp_path / "run" / "server").rglob("*"))
    finally:
        fed.close()
    assert_simulator_models(cfg, tmp_path)
    assert len(metrics["rounds"]) >= cfg.rounds
    # every payload a device sent the server (the blob refs record the uploader): its base part, nothing more
    data = load_local_data(cfg, 0)
    split = get_algorithm(cfg, data.model, cfg.kp).split
    from sqlalchemy import create_engine, text

    engine = create_engine(database_url or f"sqlite:///{tmp_path / 'run' / 'server' / 'state.db'}")
    with engine.connect() as c:
        rows = c.execute(text("SELECT r.digest, r.uploader FROM pfl_blob_refs r JOIN pfl_devices d "
                              "ON d.id = r.uploader WHERE r.federation = :f"), {"f": fed.fed}).all()
    engine.dispose()
    assert len(rows) == cfg.clients * cfg.rounds
    for digest, _ in rows:
        sent = decode(next(p for p in blobs if p.name == digest).read_bytes())
        assert set(sent.tensors) == set(split.base) and not set(sent.tensors) & set(split.personal)


def test_sampled_fedper_devices_end_with_the_simulators_models(tmp_path: Path) -> None:
    """participation 0.5 on four device processes over three rounds: the server tasks the simulator's draw only,
    each device works in the rounds that draw it and reports on the base it receives; every device ends with the
    simulator's model, each round took exactly its draw's updates, and every metric a device reported is the
    simulator's for that client and round (the agent labels it with the base's round, not its own last one)."""
    from pfl_edge.algorithms import sample_participants

    cfg = SimConfig(algorithm="fedper", clients=4, kp=2, participation=0.5, **{**BASE, "rounds": 3})
    fed = _run(tmp_path / "run", cfg.to_dict(), ["phone-mid"] * 4, broker="embedded")
    try:
        rounds = fed.get(f"{API_PREFIX}/federations/{fed.fed}/metrics")["rounds"]
        slots = {d["device_id"]: d["index"] for d in fed.get(f"{API_PREFIX}/federations/{fed.fed}/devices")}
    finally:
        fed.close()
    assert_simulator_models(cfg, tmp_path)
    sim = simulate(cfg, progress=False)
    assert [r["updates"] for r in rounds if r["round"] >= 1] == [2, 2, 2]
    assert all(r["active"] == 2 for r in rounds if r["round"] >= 1)
    reported = set()
    for r in rounds:
        for dev, m in r.get("devices", {}).items():
            assert m["accuracy"] == pytest.approx(sim["rounds"][r["round"] - 1]["client_acc"][slots[dev]], abs=1e-4)
            reported.add((r["round"], slots[dev]))
    # a device reports on round t-1's base when round t draws it, once it has trained; every device that trained
    # reports on the last base at the final step
    drawn = {t: set(sample_participants(cfg.seed, t, 4, 0.5).tolist()) for t in (1, 2, 3)}
    trained_by = {t: set().union(*(drawn[u] for u in range(1, t + 1))) for t in (1, 2, 3)}
    want = {(t - 1, i) for t in (2, 3) for i in drawn[t] & trained_by[t - 1]} | {(3, i) for i in trained_by[3]}
    assert reported == want, rounds


def test_private_fedper_devices_end_with_the_simulators_models(tmp_path: Path) -> None:
    """Differential privacy (docs/privacy.md) on four device processes: Poisson draws at rate 0.5, each device's
    update clipped on the device, the server's private mean noised from the seed's stream (``secret_noise =
    false``, the simulator's): every device ends with the simulator's model, each round took its draw's updates,
    and the server reports no epsilon (every device could subtract that noise) where the simulator states one."""
    from pfl_edge.algorithms.participants import sampled_slots

    privacy = {"clip": 0.3, "noise_multiplier": 0.4, "delta": 1e-3, "secret_noise": False}
    cfg = SimConfig(algorithm="fedper", clients=4, kp=2, participation=0.5, privacy=privacy, **{**BASE, "rounds": 3})
    fed = _run(tmp_path / "run", cfg.to_dict(), ["phone-mid"] * 4, broker="embedded")
    try:
        rounds = fed.get(f"{API_PREFIX}/federations/{fed.fed}/metrics")["rounds"]
    finally:
        fed.close()
    assert_simulator_models(cfg, tmp_path)
    sim = simulate(cfg, progress=False)
    drawn = [sampled_slots(cfg.seed, t, 4, 0.5, True) or frozenset(range(4)) for t in (1, 2, 3)]
    assert [r["updates"] for r in rounds if r["round"] >= 1] == [len(d) for d in drawn]
    # the noise came from the seed every device holds (secret_noise = false): the server reports no epsilon, while
    # the simulator states the mechanism's (issue 48)
    assert [r["epsilon"] for r in rounds if r["round"] >= 1] == [None] * 3
    assert all(0 < r["epsilon"] < float("inf") for r in sim["rounds"])


def test_secure_fedper_devices_end_with_the_simulators_models(tmp_path: Path) -> None:
    """Secure aggregation (docs/secagg.md) on four device processes: every update goes through SecAgg+'s steps
    over HTTP and leaves its device only masked; every device ends with the simulator's model (its rounds run the
    same quantized mean through the protocol in one process), and every payload a device stored on the server is
    a masked input, never a model."""
    from pfl_edge.secagg import decode_masked

    secure = {"bound": 0.5, "bits": 16}
    cfg = SimConfig(algorithm="fedper", clients=4, kp=2, secure_aggregation=secure, **BASE)
    fed = _run(tmp_path / "run", cfg.to_dict(), ["phone-mid"] * 4, broker="embedded")
    try:
        rounds = fed.get(f"{API_PREFIX}/federations/{fed.fed}/metrics")["rounds"]
        blobs = {p.name: p for p in (tmp_path / "run" / "server").rglob("*") if p.is_file()}
    finally:
        fed.close()
    assert_simulator_models(cfg, tmp_path)
    assert [r["updates"] for r in rounds if r["round"] >= 1] == [4] * cfg.rounds
    from sqlalchemy import create_engine, text

    engine = create_engine(f"sqlite:///{tmp_path / 'run' / 'server' / 'state.db'}")
    with engine.connect() as c:
        sent = [d for (d,) in c.execute(text("SELECT r.digest FROM pfl_blob_refs r JOIN pfl_devices d "
                                             "ON d.id = r.uploader WHERE r.federation = :f"), {"f": fed.fed})]
    engine.dispose()
    size = fed_model(cfg.to_dict()).secure_size()
    assert len(sent) == cfg.clients * cfg.rounds
    assert sorted(decode_masked(blobs[d].read_bytes(), size)[0] for d in sent) == sorted(
        t for t in range(1, cfg.rounds + 1) for _ in range(cfg.clients))


def test_dispfl_devices_end_with_the_simulators_models(tmp_path: Path, broker: str) -> None:
    profiles = ["phone-low", "phone-mid", "phone-high", "jetson-orin-nano"]
    from device_profiles import get_profile

    dens = tuple(get_profile(p).density for p in profiles)
    cfg = SimConfig(algorithm="dispfl", clients=4, densities=dens, options={"topology": "random:2"}, **BASE)
    fed = _run(tmp_path / "run", cfg.to_dict(), profiles, broker=broker)
    fed.close()
    assert_simulator_models(cfg, tmp_path)
    # what a device sends carries the mask its weights were trained under, not the next round's mask
    from safetensors.torch import load_file

    moved = 0
    for i in range(cfg.clients):
        d = tmp_path / "run" / "devices" / f"device-{i:02d}"
        sent = decode((d / "upload.bin").read_bytes())
        state = load_file(str(d / "model.safetensors"))
        for k, m in sent.masks.items():
            assert torch.equal(m.float(), state[f"support:{k}"]), (i, k)
            assert bool((sent.tensors[k][~m] == 0).all())
            moved += int(not torch.equal(m.float(), state[f"mask:{k}"]))
    assert moved > 0  # prune-and-regrow changed the masks after the last training


def test_a_device_killed_mid_run_picks_up_where_it_was(tmp_path: Path, broker: str) -> None:
    cfg = SimConfig(algorithm="fedper", clients=3, kp=2, **{**BASE, "rounds": 3})
    fed = _run(tmp_path / "run", cfg.to_dict(), ["phone-mid"] * 3, broker=broker, kill_and_restart=1)
    fed.close()
    assert_simulator_models(cfg, tmp_path)


@pytest.mark.parametrize("algorithm", ["fedper", "dispfl"])
def test_devices_ride_out_a_server_crash(tmp_path: Path, algorithm: str) -> None:
    """The server (and its embedded broker) SIGKILLed mid-run and restarted on the same data: devices retry
    HTTP with back-off, reconnect to the broker, and the federation ends as if nothing had happened."""
    extra = {"densities": (0.3, 0.7, 1.0), "options": {"topology": "random:2"}} if algorithm == "dispfl" else {"kp": 2}
    cfg = SimConfig(algorithm=algorithm, clients=3, **extra, **{**BASE, "rounds": 3})
    fed = _run(tmp_path / "run", cfg.to_dict(), ["phone-mid"] * 3, broker="embedded", restart_server_at=2)
    fed.close()
    assert_simulator_models(cfg, tmp_path)


@pytest.mark.parametrize("algorithm", ["fedper", "dispfl"])
def test_a_late_device_joins_from_the_next_round(tmp_path: Path, algorithm: str) -> None:
    extra = {"density": 0.5, "options": {"topology": "random:2"}} if algorithm == "dispfl" else {"kp": 2}
    cfg = SimConfig(algorithm=algorithm, clients=3, **extra, **{**BASE, "rounds": 4, "lr": 0.02, "clip_norm": 5.0})
    fed = _run(tmp_path / "run", cfg.to_dict(), ["phone-mid"] * 3, broker="embedded", late=2)
    try:
        metrics = fed.get(f"{API_PREFIX}/federations/{fed.fed}/metrics")
        devices = fed.get(f"{API_PREFIX}/federations/{fed.fed}/devices")
    finally:
        fed.close()
    late = next(d for d in devices if d["index"] == 2)
    assert late["joined_round"] >= 1  # enrolled after round 1 had opened
    reported = [r["round"] for r in metrics["rounds"] if late["device_id"] in r["devices"]]
    # it reports from the round after it joined up to the last, and never for rounds before it joined
    assert reported and min(reported) > late["joined_round"] and max(reported) == cfg.rounds
    assert (tmp_path / "run" / "devices" / "device-02" / "final.safetensors").exists()


@pytest.mark.parametrize("algorithm", ["fedper", "dispfl"])
def test_devices_on_the_program_and_without_torch_end_where_the_simulator_does(tmp_path: Path,
                                                                               algorithm: str) -> None:
    """Device 0 trains with an ExecuTorch training program (the server's, downloaded through its model card and
    checked; weights swapped in every round) on torch tensors; device 1 runs as a device without torch does
    (``--arrays numpy``: numpy arrays throughout, the same program trains, the server's ONNX program evaluates, the
    whole initial model comes from the server, batches and masks drawn by numpy's seeding.MT); device 2 trains in
    eager PyTorch. All end with the simulator's models, within float tolerance."""
    extra = {"densities": (0.5, 1.0, 0.3), "options": {"topology": "random:2"}} if algorithm == "dispfl" else {"kp": 2}
    cfg = SimConfig(algorithm=algorithm, clients=3, **extra, **BASE)
    fed = _run(tmp_path / "run", cfg.to_dict(), ["phone-mid"] * 3, broker="embedded",
               extra={0: ["--training-backend", "executorch"], 1: ["--arrays", "numpy"],
                      2: ["--training-backend", "torch"]})
    fed.close()
    devices = tmp_path / "run" / "devices"
    programs = devices / "device-00" / "programs"
    assert list(programs.glob("*.pte")) and not (programs / "manifest.json").exists()  # downloaded, not exported
    assert not list(programs.glob("*.onnx"))  # it evaluates in eager PyTorch
    assert list((devices / "device-01" / "programs").glob("*.onnx"))  # the numpy device evaluates with ONNX
    assert_simulator_models(cfg, tmp_path)


def test_ditto_devices_end_with_the_simulators_models_and_keep_their_personal_model(tmp_path: Path) -> None:
    """Ditto on three device processes, device 0 training through the ExecuTorch program (the proximal pull
    added by ProgramSGD), the others in eager PyTorch: every device deploys the simulator's personal model, and
    everything a device sent is its copy of the global model, never the personal one."""
    from safetensors.torch import load_file

    cfg = SimConfig(algorithm="ditto", clients=3, options={"lam": 0.5}, **BASE)
    fed = _run(tmp_path / "run", cfg.to_dict(), ["phone-mid"] * 3, broker="embedded",
               extra={0: ["--training-backend", "executorch"]})
    fed.close()
    assert_simulator_models(cfg, tmp_path)
    model_keys = set(load_local_data(cfg, 0).model.state_dict())
    blobs = {p.name: p for p in (tmp_path / "run" / "server").rglob("*") if p.is_file()}
    for i in range(cfg.clients):
        d = tmp_path / "run" / "devices" / f"device-{i:02d}"
        state = load_file(str(d / "model.safetensors"))
        personal = {k.removeprefix("personal:"): v for k, v in state.items() if k.startswith("personal:")}
        assert set(personal) == model_keys
        sent = decode((d / "upload.bin").read_bytes()).tensors
        assert set(sent) == model_keys
        assert all(torch.equal(sent[k], state[k]) for k in sent)  # its global copy, as trained
        assert all(not torch.equal(sent[k], personal[k]) for k in sent if sent[k].dim() > 1)
        for line in (d / "ledger.jsonl").read_text().splitlines():  # every update it posted, as the server stored it
            digest = json.loads(line)["digest"]
            assert set(decode(blobs[digest].read_bytes()).tensors) == model_keys


def test_fedrep_devices_end_with_the_simulators_models_and_send_only_the_base(tmp_path: Path) -> None:
    """FedRep on three device processes, device 0 training both phases through the ONNX whole-model program (the
    other part's gradients left unapplied), the others in eager PyTorch: every device ends with the simulator's
    model, and every update the server stored holds the base alone, never a head tensor."""
    cfg = SimConfig(algorithm="fedrep", clients=3, kp=2, options={"head_epochs": 2}, **BASE)
    fed = _run(tmp_path / "run", cfg.to_dict(), ["phone-mid"] * 3, broker="embedded",
               extra={0: ["--training-backend", "onnxruntime"]})
    fed.close()
    assert_simulator_models(cfg, tmp_path)
    assert "training with the onnxruntime backend" in (tmp_path / "run" / "devices" / "device-00.log").read_text()
    data = load_local_data(cfg, 0)
    split = get_algorithm(cfg, data.model, cfg.kp).split
    blobs = {p.name: p for p in (tmp_path / "run" / "server").rglob("*") if p.is_file()}
    for i in range(cfg.clients):
        ledger = (tmp_path / "run" / "devices" / f"device-{i:02d}" / "ledger.jsonl").read_text().splitlines()
        assert ledger
        for line in ledger:
            assert set(decode(blobs[json.loads(line)["digest"]].read_bytes()).tensors) == set(split.base)


@pytest.mark.skipif(MOSQUITTO is None, reason="needs the mosquitto binary")
def test_an_external_broker_restart_loses_nothing(tmp_path: Path) -> None:
    """Mosquitto without persistence restarted mid-run: retained tasks and sessions are gone; the server
    re-publishes the current tasks when its link reconnects, devices resubscribe, and the run ends as the
    simulator's."""
    port = free_port()
    conf = tmp_path / "m.conf"
    procs = [_mosquitto(conf, port)]

    def restart() -> None:
        procs[0].kill()
        procs[0].wait()
        time.sleep(1.0)
        procs.append(_mosquitto(conf, port))

    cfg = SimConfig(algorithm="fedper", clients=3, kp=2, **{**BASE, "rounds": 3})
    try:
        fed = _run(tmp_path / "run", cfg.to_dict(), ["phone-mid"] * 3, broker=f"mqtt://127.0.0.1:{port}",
                   at_round=(2, restart))
        fed.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert len(procs) == 2  # the broker was restarted
    assert_simulator_models(cfg, tmp_path)


@pytest.mark.skipif(MOSQUITTO is None, reason="needs the mosquitto binary")
def test_the_server_republishes_tasks_a_restarted_broker_forgot(tmp_path: Path) -> None:
    """A device that was away while the broker restarted (retained messages gone) still finds its task: the
    server publishes every current task again when its MQTT link reconnects."""
    import json

    import paho.mqtt.client as mqtt

    from pfl_edge.protocol import task_topic

    port = free_port()
    conf = tmp_path / "m.conf"
    procs = [_mosquitto(conf, port)]
    cfg = SimConfig(algorithm="fedper", clients=2, kp=2, **BASE)
    fed = start_server(tmp_path / "run", broker_url=f"mqtt://127.0.0.1:{port}")
    try:
        fed.create("republish", cfg.to_dict())
        ids = []
        for i in range(2):
            r = fed.http.post(f"{API_PREFIX}/devices", json={"federation": fed.fed, "enrol_secret": fed.secret,
                                                            "profile": "phone-mid", "index": i})
            assert r.status_code == 201, r.text
            ids.append(r.json()["device_id"])
        deadline = time.monotonic() + 30
        while fed.info()["state"] != "collecting" and time.monotonic() < deadline:
            time.sleep(0.2)
        procs[0].kill()
        procs[0].wait()
        procs.append(_mosquitto(conf, port))  # empty: no retained task survives

        got: list[dict[str, Any]] = []
        sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="late-reader", protocol=mqtt.MQTTv311)
        sub.on_message = lambda c, u, m: got.append(json.loads(m.payload))
        sub.connect("127.0.0.1", port)
        sub.subscribe(task_topic(fed.fed, ids[1]), qos=1)
        sub.loop_start()
        deadline = time.monotonic() + 30  # the server's link reconnects within its back-off (<= 10 s)
        while not got and time.monotonic() < deadline:
            time.sleep(0.2)
        sub.loop_stop()
        sub.disconnect()
        assert got and got[0]["round"] == 1 and got[0]["federation"] == fed.fed
    finally:
        fed.close()
        for p in procs:
            p.kill()
            p.wait()
