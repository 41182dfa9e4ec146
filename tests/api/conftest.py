"""Fixtures of the API tests: one shared service on the real default voice, and the fault-injecting engine."""
from __future__ import annotations

from typing import Iterator

import pytest

from apitools import FaultPipeline, Server, api_config, run_server
from cosyedge.device.engine import Engine


@pytest.fixture(scope="session")
def server(default_engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The service most tests talk to: default settings, the real default voice."""
    with run_server(api_config(tmp_path_factory.mktemp("api_state")), default_engine) as srv:
        yield srv


@pytest.fixture(scope="session")
def fault_engine(default_engine: Engine) -> Engine:
    return Engine(default_engine.bundle, FaultPipeline(default_engine.pipeline), default_engine.precision,
                  default_engine.limits)


@pytest.fixture
def fault_pipeline(fault_engine: Engine) -> Iterator[FaultPipeline]:
    pipeline = fault_engine.pipeline
    pipeline.holding.clear()
    pipeline.release.clear()
    pipeline.free = 0
    yield pipeline
    pipeline.release.set()
