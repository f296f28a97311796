"""Image pulls on the node's Docker Engine (H7): pulled when absent, one pull per image.

``ImagePuller.ensure`` is called by a launch (in a worker thread) before the container
is created. The first launch that needs an absent image pulls it; every launch of the
same image that comes while that pull runs waits on it and gets its outcome — one pull
per image per node, whoever asked. Each waiter hears the progress (``PullProgress``,
summed over the layers) through its own callback.

The credential (``auth``: username and password for the image's registry, sent by the
server with the claimed task) goes to the Engine only as the pull's ``X-Registry-Auth``
header (the SDK's ``auth_config``): never in argv, the environment, a log line or an
event. Without one, the Engine's own configuration applies (a ``docker login`` on the
node).

A pull ends within ``timeout_s``: the deadline is checked at every line of Docker's
stream, and a stream that goes silent meets the client's socket timeout; the pull's
connection is then closed, which makes the Engine cancel it. A failure raises
``PullFailed`` with its kind (``core.images.PullFailure``) and a status line that says
what to do.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import docker.errors

from heteroflow.agent.runtime.protocol import PullFailed
from heteroflow.core.images import PullFailure, PullProgress, classify

log = logging.getLogger(__name__)

Progress = Callable[[PullProgress], None]


@dataclass
class _Pull:
    progress: PullProgress
    listeners: list[Progress] = field(default_factory=list)
    finished: threading.Event = field(default_factory=threading.Event)
    error: PullFailed | None = None


class ImagePuller:
    """One pull per image on this Engine at a time (see the module docstring)."""

    def __init__(
        self, client: Any, *, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self.client = client
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._pulls: dict[str, _Pull] = {}
        self.pulls_started = 0  # how many pulls this puller began (tests, metrics)

    def present(self, image: str) -> bool:
        try:
            self.client.api.inspect_image(image)
        except docker.errors.NotFound:  # ImageNotFound included
            return False
        return True

    def ensure(
        self,
        image: str,
        auth: Mapping[str, str] | None,
        timeout_s: float,
        on_progress: Progress | None = None,
    ) -> bool:
        """Make ``image`` present; True when a pull was needed (by this call or one it
        waited on). ``PullFailed`` when it could not be pulled."""
        if self.present(image):
            return False
        with self._lock:
            pull = self._pulls.get(image)
            owner = pull is None
            if pull is None:
                pull = self._pulls[image] = _Pull(PullProgress(image))
                self.pulls_started += 1
            if on_progress is not None:
                pull.listeners.append(on_progress)
        if not owner:
            if not pull.finished.wait(timeout_s):
                raise PullFailed(image, PullFailure.TIMEOUT,
                                 f"waited {timeout_s:g} s on the pull another launch began")
            if pull.error is not None:
                raise pull.error
            return True
        try:
            self._pull(image, pull, auth, timeout_s)
        except PullFailed as exc:
            pull.error = exc
            raise
        except Exception as exc:  # never leave the waiters hanging
            pull.error = PullFailed(image, classify(str(exc)), str(exc))
            raise pull.error from exc
        finally:
            with self._lock:
                self._pulls.pop(image, None)
            pull.finished.set()
        return True

    def _pull(
        self, image: str, pull: _Pull, auth: Mapping[str, str] | None, timeout_s: float
    ) -> None:
        started = self._monotonic()
        log.info("pulling image %s", image)
        stream = self._stream(image, auth)
        try:
            for event in stream:
                pull.progress.feed(event)
                if pull.progress.error:
                    error = pull.progress.error
                    raise PullFailed(image, classify(error), error)
                for listener in list(pull.listeners):
                    listener(pull.progress)
                if self._monotonic() - started > timeout_s:
                    raise PullFailed(
                        image, PullFailure.TIMEOUT,
                        f"not pulled within {timeout_s:g} s ({pull.progress.text()})",
                    )
        except docker.errors.APIError as exc:
            text = str(exc.explanation or exc)
            raise PullFailed(image, classify(text), text) from exc
        except (OSError, docker.errors.DockerException) as exc:  # socket timeouts included
            text = str(exc)
            kind = classify(text)
            if kind in (PullFailure.OTHER, PullFailure.UNREACHABLE) and "timed out" in text:
                kind = PullFailure.TIMEOUT
            raise PullFailed(image, kind, text) from exc
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()  # a pull abandoned early: the Engine cancels it
        if not self.present(image):
            raise PullFailed(image, PullFailure.OTHER, "the pull ended without the image")
        log.info("pulled image %s in %.1f s", image, self._monotonic() - started)

    def _stream(self, image: str, auth: Mapping[str, str] | None) -> Iterator[dict[str, Any]]:
        kwargs: dict[str, Any] = {"stream": True, "decode": True}
        if auth:
            kwargs["auth_config"] = {"username": auth["username"], "password": auth["password"]}
        try:
            stream: Iterator[dict[str, Any]] = self.client.api.pull(image, **kwargs)
        except docker.errors.APIError as exc:
            text = str(exc.explanation or exc)
            raise PullFailed(image, classify(text), text) from exc
        except (OSError, docker.errors.DockerException) as exc:
            raise PullFailed(image, classify(str(exc)), str(exc)) from exc
        return stream
