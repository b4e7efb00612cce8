"""The service's client and wire format without a service: what it says when nobody answers, and that every
record the store hands out crosses the wire unchanged (a real store's records, compared field by field)."""
from __future__ import annotations

import json
import time

import pytest

from db import Store
from migrate.localrun import free_port
from service import client
from service.codec import CodecError, decode, encode
from service.errors import ServiceError


def test_a_service_that_refuses_connections_is_waited_for_then_named(monkeypatch, capsys):
    monkeypatch.setattr(client, "RETRY_S", 1.5)
    monkeypatch.setattr(client.munge, "mint", lambda payload, **kw: "MUNGE:test")
    store = client.ServiceStore(f"http://127.0.0.1:{free_port()}")
    began = time.monotonic()
    with pytest.raises(ServiceError, match=r"refused connections .* for .*\(is `elastic serve` running"):
        store.find_job("x")
    assert time.monotonic() - began >= 1.0  # it waited and tried again before giving up
    assert capsys.readouterr().err.count("refuses connections or throttles them: trying again") == 1


def test_every_record_of_a_real_store_crosses_the_wire_unchanged(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/e.db")
    job_id = store.create_job("t", "pp1tp1dp2", 2, 4, nodes=["n1", "n2"], owner="alice", owner_uid=1001)
    store.record_rank_map(job_id, 0, "pp1tp1dp2", [
        {"virtual_rank": r, "node": f"n{r + 1}", "gpu": 0, "pp": 0, "dp": r, "tp": 0} for r in range(2)])
    mid = store.start_migration(job_id, "pp1tp1dp2", "pp1tp1dp1", "resize", {"sends": 1}, store.fragmentation(job_id))
    store.finish_migration(mid, "succeeded", 10, 0, True, {"plan": 0.1}, at_step=3)
    store.queue_request(job_id, "shrink", {"nodes": 1}, "alice")
    store.record_steps(job_id, [(1, 2.5, "pp1tp1dp2")])
    values = [store.get_job(job_id), store.list_nodes(job_id), store.current_rank_map(job_id),
              store.get_migration(mid), store.list_requests(job_id), store.steps(job_id), store.placement(job_id),
              store.history(), store.jobs_page(), store.audit_log()]
    for value in values:
        assert decode(json.loads(json.dumps(encode(value)))) == value
    with pytest.raises(CodecError):
        encode(object())
    with pytest.raises(CodecError):
        decode({"$rec": "Popen", "v": {}})


def test_dashboard_users_are_not_added_through_the_service(capsys):
    from launcher.cli import main

    assert main(["dashboard", "--db", "http://127.0.0.1:9", "--add-user", "x", "--password-stdin"]) == 2
    assert "is the shared service" in capsys.readouterr().err
