"""Schemathesis over /openapi.json against the app with a model-free engine (ASGI, no socket):
whatever a body holds, valid by the schema or not, the answer is never a 5xx (but the 504 of
a missed hard deadline, which deadline_kind documents). Bounded in examples per route so that
it runs in seconds."""
from __future__ import annotations

import pytest
import schemathesis
from schemathesis import GenerationMode
from conftest import FakeExecutor
from fake_server import MODEL, fake_engine
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from batchserve.server.app import create_app
from batchserve.server.config import ServerConfig

pytestmark = pytest.mark.http



class FreshApp:
    """A new app, and engine, per ASGI lifespan: schemathesis runs one per test (one per route),
    and an engine does not start again once shut down. A short context and instant steps: a
    fuzzed max_tokens either fails the length check or ends soon. Not leak-checked: the last
    lifespan may outlive the test."""

    def __init__(self) -> None:
        self.app = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan" or self.app is None:
            engine = fake_engine(FakeExecutor(step_time=0.0, max_model_len=64), check_leaks=False)
            self.app = create_app(engine, ServerConfig(allowed_hosts="testserver"), MODEL)  # schemathesis's Host
        await self.app(scope, receive, send)


schema = schemathesis.openapi.from_asgi("/openapi.json", FreshApp())
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])  # invalid bodies too


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_error(case):
    response = case.call()
    if response.status_code == 504 and response.json()["error"]["code"] == "deadline_exceeded":
        return  # a hard deadline too short to meet: the 504 the field documents, not a fault
    case.validate_response(response, checks=[not_a_server_error])
