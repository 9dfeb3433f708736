"""Escalation mail through a real SMTP server on loopback (aiosmtpd), and the
daemon's retries when the relay is down."""

from __future__ import annotations

import asyncio
import socket

import pytest

from artemisd import mail
from artemisd.decide import CORROBORATION_WAIT_S
from artemisd.config import MailSettings
from tests.unit.test_server import HEALTHY, HOT, SLOW_BUSY, Clock, Harness, cluster, smtp  # noqa: F401 - fixture


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_message_carries_incident_and_stable_id(smtp):
    box, relay = smtp
    settings = MailSettings(mail_relay=relay, mail_to=("a@example.org", "b@example.org"),
                            mail_from="artemis@cluster.example.org")
    assert mail.send(settings, "INC-4 gpu.power rank 1", "body text", "artemis.INC-4.9")
    [msg] = box.messages
    assert msg.rcpt_tos == ["a@example.org", "b@example.org"]
    text = msg.content.decode()
    assert "Subject: [artemis] INC-4 gpu.power rank 1" in text
    assert "Message-ID: <artemis.INC-4.9@cluster.example.org>" in text


def test_no_relay_configured_sends_nothing():
    assert mail.send(MailSettings(), "s", "t", "id") is False


def test_unreachable_relay_raises_mail_error():
    with pytest.raises(mail.MailError):
        mail.send(MailSettings(mail_relay=f"127.0.0.1:{free_port()}", mail_to=("a@b",), mail_timeout=2),
                  "s", "t", "id")


def test_daemon_retries_mail_until_the_relay_is_back(tmp_path, smtp):
    box, relay = smtp
    dead = f"127.0.0.1:{free_port()}"

    async def scenario():
        conf = f"MailRelay={dead}\nMailTo=admins@example.org\nMailTimeout=2\nPartitionPolicy=gpu Auto=escalate\n"
        async with Harness(tmp_path, conf, cluster(), Clock()) as h:
            await h.windows(range(0, 8), HEALTHY)
            await h.windows(range(8, 11), SLOW_BUSY, gpu=HOT)
            h.clock.now += CORROBORATION_WAIT_S  # no node check looks: escalated once the drain waited for it
            await h.daemon.run_once()
            [inc] = await h.incidents()
            [esc] = [a for a in (await h.show(inc["id"]))["actions"] if a["kind"] == "escalate"]
            assert esc["status"] == "running" and "SMTP relay" in esc["detail"]
            # The AdminComment part is done once, not repeated on every retry.
            assert h.slurm.jobs["100"].admin_comment.count(inc["id"]) == 1
            h.daemon.reload(h.config.model_copy(update={"mail": h.config.mail.model_copy(
                update={"mail_relay": relay})}))
            h.clock.now += 3600
            await h.daemon.run_once()
            [esc] = [a for a in (await h.show(inc["id"]))["actions"] if a["kind"] == "escalate"]
            assert esc["status"] == "done"
            assert len(box.messages) == 1
            assert h.slurm.jobs["100"].admin_comment.count(inc["id"]) == 1
    asyncio.run(scenario())
