"""The members of one etcd cluster as a client of it uses them: which member it talks to, each call tried on
the next member when one does not answer, and the configured user's token.

Each client starts with a member drawn at random, as etcd's own client balances: every node is given the same
endpoints, and a cluster whose nodes all started with the first would serve every call and every watch of the
job (a plan's fan-out to each watcher above all) from that one member. A member that stops answering is left
for the next, so losing one member of three is not noticed by the job.
"""

from __future__ import annotations

import random
from typing import Any

from ftrun.paths import Unreadable, read_small_file
from ftrun.store.etcd_config import CONF_FILE_LIMIT, EtcdOptions, EtcdRefused, EtcdUnavailable, EtcdUnreachable
from ftrun.store.etcd_http import Member, Tls


def _body(answer: dict[str, Any]) -> dict[str, Any]:
    """The message of an answer: a streaming call's (a keep-alive) is wrapped in ``result``."""
    result = answer.get("result")
    return result if isinstance(result, dict) and "header" not in answer else answer


class EtcdCluster:
    """The members at ``options.endpoints`` (over TLS where the options ask), each call bounded by ``timeout``."""

    def __init__(self, options: EtcdOptions, timeout: float) -> None:
        self.options = options
        tls = options.https or bool(options.ca_cert or options.cert)
        tls_files = Tls(options.ca_cert, options.cert, options.key) if tls else None
        self._members = [Member(host, port, tls_files, timeout) for host, port in options.endpoints]
        self.current = random.randrange(len(self._members))
        """Which of the endpoints (an index into ``options.endpoints``) the next call goes to first."""

    @property
    def member(self) -> Member:
        """The member the next call (and a watch opened now) goes to."""
        return self._members[self.current]

    def move_on(self) -> None:
        """Leave the current member for the next: it went away (a watch on it ended, or could not open)."""
        self.current = (self.current + 1) % len(self._members)

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` on the first member that answers, starting with the current one, which
        it then stays."""
        failures = []
        for turn in range(len(self._members)):
            index = (self.current + turn) % len(self._members)
            try:
                answer = self._post(self._members[index], path, body)
            except OSError as exc:
                host, port = self.options.endpoints[index]
                failures.append(f"{host}:{port}: {exc}")
                continue
            self.current = index
            return answer
        raise EtcdUnreachable(f"no etcd endpoint answered ({'; '.join(failures)})")

    def _post(self, member: Member, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One call; a refused token is renewed once; any other refusal is EtcdUnavailable. With a user name, a
        member is asked for a token before the first call to it (only the members a client uses are asked)."""
        if self.options.user and "Authorization" not in member.headers:
            self._authenticate(member)
        for attempt in range(2):
            try:
                answer = member.post(path, body)
            except ValueError:
                raise EtcdUnavailable(f"etcd: the answer to {path} is not JSON") from None
            except EtcdRefused as exc:
                text = str(exc)
                if attempt == 0 and self.options.user and "token" in text:
                    self._authenticate(member)
                    continue
                raise EtcdUnavailable(f"etcd refused {path}: {text[:200]}") from None
            if not isinstance(answer, dict) or not isinstance(_body(answer).get("header"), dict):
                raise EtcdUnavailable(f"etcd: the answer to {path} is not etcd's (no header)")
            return _body(answer)
        raise EtcdUnavailable(f"etcd refused {path}")  # pragma: no cover -- the loop returns or raises

    def _authenticate(self, member: Member) -> None:
        """Take a token for the configured user from ``member`` (skipped while it is down, or refuses: the call
        that needed the token then says why). The password is read from its file each time, never kept."""
        password = ""
        if self.options.password_file:
            try:
                password = read_small_file(self.options.password_file, CONF_FILE_LIMIT)[0].decode("utf-8").strip()
            except (Unreadable, UnicodeDecodeError) as exc:
                raise EtcdUnavailable(f"etcd: cannot read the password file: {exc}") from None
        try:
            answer = member.post("auth/authenticate", {"name": self.options.user, "password": password})
        except (OSError, ValueError, EtcdRefused):
            return
        token = answer.get("token") if isinstance(answer, dict) else None
        if isinstance(token, str):
            member.headers["Authorization"] = token
