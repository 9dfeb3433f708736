"""Escalation email through the site's SMTP relay (smtplib).

Blocking; the daemon calls it from a worker thread.  Every message carries a
``Message-ID`` derived from the incident and action, so if a crash lands
between the relay accepting a message and the daemon recording it, the
repeated message is recognisable as the same one (mail clients thread or
drop it) — SMTP offers no way to ask "did you get this already?".
"""

from __future__ import annotations

import smtplib
import socket
from email.message import EmailMessage
from email.utils import formatdate

from artemisd.config import MailSettings


class MailError(RuntimeError):
    """The relay could not be reached or refused the message (retried with backoff)."""


def compose(settings: MailSettings, subject: str, text: str, message_id: str) -> EmailMessage:
    msg = EmailMessage()
    msg["From"] = settings.mail_from
    msg["To"] = ", ".join(settings.mail_to)
    msg["Subject"] = f"{settings.mail_subject_prefix} {subject}".strip()
    msg["Date"] = formatdate(localtime=False)
    domain = settings.mail_from.rpartition("@")[2] or "localhost"
    msg["Message-ID"] = f"<{message_id}@{domain}>"
    msg.set_content(text)
    return msg


def send(settings: MailSettings, subject: str, text: str, message_id: str) -> bool:
    """Send one message; False when no relay or no recipient is configured."""
    if not settings.mail_relay or not settings.mail_to:
        return False
    host, _, port = settings.mail_relay.rpartition(":")
    msg = compose(settings, subject, text, message_id)
    try:
        with smtplib.SMTP(host.strip("[]"), int(port), timeout=settings.mail_timeout) as smtp:
            smtp.send_message(msg)
    except (OSError, smtplib.SMTPException, socket.timeout) as err:
        raise MailError(f"SMTP relay {settings.mail_relay}: {err}") from None
    return True
