"""Owns the test harness for real backing services: throwaway Postgres, ZooKeeper
and RabbitMQ.

Everything here starts real server processes from nothing, binds them to loopback on
non-default free ports, and stops them by PID. Nothing is downloaded.
"""

from __future__ import annotations

from tests.services.ports import ServiceError, free_port, free_ports
from tests.services.postgres import PostgresServer
from tests.services.rabbitmq import RabbitMQServer
from tests.services.zookeeper import ZooKeeperEnsemble

__all__ = [
    "PostgresServer",
    "RabbitMQServer",
    "ServiceError",
    "ZooKeeperEnsemble",
    "free_port",
    "free_ports",
]
