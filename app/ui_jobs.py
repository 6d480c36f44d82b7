"""The UI's generation jobs, without gradio: one `Job` per Generate click, with its own id, registered when the
click is made (before gradio queues the run) and claimed by the run when its turn comes. Cancel cancels the
session's jobs that exist when it is pressed: a queued one ends without running when its turn comes, a running one
stops after its current chunk; a job submitted after the Cancel is not affected, nor is another session's."""
from __future__ import annotations

import itertools
import threading
import uuid

_ORDER = itertools.count()  # submission order (gradio runs a session's queued generations first in, first out)


class Job:
    """One generation's live controls, read by its run between chunks: cancel, and the camera action that steers
    it (sticky: the key pressed last)."""

    def __init__(self, session: str):
        self.id = uuid.uuid4().hex
        self.order = next(_ORDER)
        self.session = session
        self.cancel = threading.Event()
        self.steer: str | None = None
        self.steerable = True  # (its run's pipeline takes camera actions: the embedded world model)
        self.running = False
        self.stale = False  # queued, and a job of its session submitted later has started (see Jobs.start)


class Jobs:
    """The jobs submitted and not yet finished, by id (gradio runs the handlers in worker threads: one lock)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_id: dict[str, Job] = {}

    def submit(self, session: str) -> Job:
        """A new queued job of this session (the Generate click; its id goes with the queued request)."""
        job = Job(session)
        with self._lock:
            self._by_id[job.id] = job
        return job

    def start(self, job_id: str | None, session: str, steerable: bool = True) -> Job:
        """The run's job, now running: the queued job with this id, if it is this session's; otherwise (an API call
        that took no id, an id already used or another session's) a new job, which Cancel reaches from now on.
        This session's jobs submitted before it and not started are marked stale: most likely gradio refused their
        input before their run began (an API value outside a slider's range), so Cancel stops counting them; one
        that does start after all (two clicks queued in the other order) is found as usual, a Cancel honoured."""
        with self._lock:
            job = self._by_id.get(job_id or "")
            if job is None or job.session != session or job.running:
                job = Job(session)
                self._by_id[job.id] = job
            else:
                for old in self._by_id.values():
                    if old.session == session and old.order < job.order and not old.running:
                        old.stale = True
            job.running, job.stale, job.steerable = True, False, steerable
            return job

    def finish(self, job: Job) -> None:
        with self._lock:
            self._by_id.pop(job.id, None)
        job.running, job.steer = False, None

    def cancel(self, session: str) -> tuple[int, int]:
        """Cancel this session's jobs: (running, queued) how many; queued ones an earlier Cancel reached are not
        counted again (they stay registered, cancelled, so that their run still ends at once if it comes)."""
        with self._lock:  # (two Cancels at once count each queued job once)
            mine = [j for j in self._by_id.values() if j.session == session]
            fresh = [j for j in mine if not j.cancel.is_set()]
            for j in mine:
                j.cancel.set()
        running = sum(j.running for j in mine)
        return running, sum(not j.running and not j.stale for j in fresh)

    def busy(self) -> bool:
        """Whether any session's job is running (a new one then waits in the queue)."""
        with self._lock:
            return any(j.running for j in self._by_id.values())

    def running(self, session: str) -> Job | None:
        with self._lock:
            return next((j for j in self._by_id.values() if j.session == session and j.running), None)

    def drop(self, session: str) -> None:
        """The session ended (its page closed): cancel its jobs and forget the queued ones (the running one is
        forgotten when it finishes)."""
        self.cancel(session)
        with self._lock:
            for j in [j for j in self._by_id.values() if j.session == session and not j.running]:
                del self._by_id[j.id]

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)


def cancel_message(running: int, queued: int) -> str:
    """What Cancel says, from Jobs.cancel's counts."""
    will_not_run = "your queued job will not run" if queued == 1 else f"your {queued} queued jobs will not run"
    if running:
        return "**Cancelling**: the video stops after the current chunk" + (f"; {will_not_run}." if queued else ".")
    return f"**Cancelled**: {will_not_run}." if queued else "Nothing is running."
