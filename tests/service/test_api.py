"""The service's API in the dashboard's app, without munge: what it answers before any credential is read."""
from __future__ import annotations

from dashboard import create_app
from tests.dashboard.conftest import SECRET


def test_calls_without_a_credential_are_refused_and_floods_throttled_before_anything_runs(tmp_path):
    app = create_app({"DB_URL": f"sqlite:///{tmp_path}/e.db", "SECRET_KEY": SECRET, "TESTING": True,
                      "API_RATE_LIMIT": "3 per minute"})
    client = app.test_client()
    answers = [client.post("/api/v1/list_jobs", data=b"{}") for _ in range(4)]
    assert [a.status_code for a in answers] == [401, 401, 401, 429]
    assert "no munge credential" in answers[0].json["error"] and int(answers[3].headers["Retry-After"]) > 0
    assert client.post("/api/v1/drop_everything", data=b"{}", environ_base={"REMOTE_ADDR": "10.0.0.2"}).json[
        "kind"] == "no_method"
    store = app.extensions["elastic_store"]
    assert [r.who for r in store.audit_log(limit=10) if r.action == "api:list_jobs"] == ["anonymous"] * 3
