"""A warm ClientApp process: a SuperNode's ClientApp tasks run one after another in one long-lived process.

Flower 1.42's `flwr-clientapp` executes one task (one message) and exits, so a SuperNode with the default
`--isolation subprocess` starts a fresh process per message, which imports torch and rebuilds its client data every
time. Started beside `flower-supernode --isolation process` in place of `flower-superexec`, `WarmClientApp` acquires
each ClientApp task from the SuperNode's Runtime API and runs the ClientApp here, so the imports, the loaded app and
`tafl.training.flower`'s node cache carry over from message to message. Each task goes through the same Runtime calls
as `flwr-clientapp` (the helpers of `flwr.supernode.runtime.run_clientapp`) without the process exit at its end; tafl
pins flwr to 1.42, whose Runtime API this speaks. Imported only by `tafl.training.flower.serve_clientapp` (Flower is
the `federated` extra).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from flwr.app import Message
from flwr.app.error import Error
from flwr.cli.install import install_from_fab
from flwr.clientapp.client_app import LoadClientAppError
from flwr.clientapp.utils import get_load_client_app_fn
from flwr.common.constant import ErrorCode, SubStatus
from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
from flwr.proto.runtime_pb2 import (AcquireTaskRequest, PullAppMessagesRequest,  # pylint: disable=E0611
                                    PullTaskInputRequest, SendTaskHeartbeatRequest)
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender
from flwr.supercore.inflatable.inflatable_protobuf_utils import (make_confirm_message_received_fn_protobuf,
                                                                 make_pull_object_fn_protobuf)
from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
from flwr.supercore.interceptors import (RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor,
                                         SuperExecAuthHttpInterceptor)
from flwr.supercore.retry import RetryInvoker, exponential
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.task_identity import TaskIdentity
from flwr.supercore.tls import validate_and_resolve_root_certificates
from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

# the ClientApp's own messages and the process's task lines keep the logger they always had (tests read them)
log = logging.getLogger("tafl.training.flower")

MESSAGE_WAIT_S = 120.0  # how long a task's message may take to reach the SuperNode after the task was handed out


class WarmClientApp:
    """The connections to one SuperNode's Runtime API and the ClientApps loaded from its FABs."""

    def __init__(self, runtime_api_address: str, *, insecure: bool = False, root_certificates: str | None = None,
                 superexec_auth_secret: bytes | None = None):
        self.address, self.insecure = runtime_api_address, insecure
        self.certs = validate_and_resolve_root_certificates(root_certificates, insecure)
        auth = ([SuperExecAuthHttpInterceptor(master_secret=superexec_auth_secret,
                                              protected_methods=frozenset({"/flwr.proto.Runtime/AcquireTask"}))]
                if superexec_auth_secret else [])
        self.acquirer = RuntimeHttpClient.from_server_address(
            server_address=runtime_api_address, insecure=insecure, root_certificates=self.certs,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec"), *auth])
        self.load_app = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)
        self.apps: dict[str, Any] = {}  # FAB hash -> the loaded ClientApp, installed once

    @staticmethod
    def retry() -> RetryInvoker:
        """Transport errors and 502/503/504 for up to a minute; never signals this process."""
        return RetryInvoker(lambda: exponential(max_delay=5), (httpx.TransportError, httpx.HTTPStatusError),
                            max_tries=None, max_time=60.0,
                            should_giveup=lambda e: isinstance(e, httpx.HTTPStatusError)
                            and e.response.status_code not in (502, 503, 504))

    def http_client(self, interceptors: list) -> RuntimeHttpClient:
        return RuntimeHttpClient.from_server_address(
            server_address=self.address, insecure=self.insecure, root_certificates=self.certs,
            interceptors=interceptors, retry_invoker=self.retry())

    @staticmethod
    def pull_task_input(client: RuntimeHttpClient):
        """flwr's pull_task_input, for a process that polls fast: the SuperNode hands out a task before
        it has fetched the message (and its objects) from the SuperLink, which a freshly started
        flwr-clientapp never noticed. Wait for the message, and retry its objects every 0.05-0.5 s
        instead of flwr's 1-10 s backoff."""
        res = client.PullTaskInput(PullTaskInputRequest())
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = (res.task_id, res.run.run_id,
                                                                           res.context.node_id)
        context, run, fab = context_from_proto(res.context), run_from_proto(res.run), fab_from_proto(res.fab)
        deadline = time.monotonic() + MESSAGE_WAIT_S
        while not (msgs := client.PullMessages(PullAppMessagesRequest())).messages_list:
            if time.monotonic() > deadline:
                raise RuntimeError("the SuperNode gave a task but no message within 120 s")
            time.sleep(0.05)
        node, tree = Node(node_id=context.node_id), msgs.message_object_trees[0]
        message = pull_and_inflate_object_from_tree(
            tree, make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
            make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
            return_type=Message, max_time=600.0, initial_backoff=0.05, backoff_cap=0.5)
        message.metadata.__dict__["_message_id"] = tree.object_id  # as flwr: the deflated message lacks its own id
        return message, context, run, fab

    def run_task(self, token: str) -> str:
        """One task: pull its message, run the ClientApp on it, push the reply (an error reply when the app
        raised) and the task's end. Returns a line for the log: the message type and each phase's seconds."""
        client = self.http_client([RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                                   RuntimeTokenHttpInterceptor(token)])
        beat = HeartbeatSender(self.heartbeat_fn(client))
        message = reply = context = None
        status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        marks = [time.perf_counter()]  # pulled, ran, pushed
        try:
            beat.start()
            message, context, run, fab = self.pull_task_input(client)
            if fab.hash_str not in self.apps:
                install_from_fab(fab.content, skip_prompt=True)
                self.apps[fab.hash_str] = self.load_app(run.fab_id, run.fab_version, fab.hash_str)
            marks.append(time.perf_counter())
            reply = self.apps[fab.hash_str](message=message, context=context)
            marks.append(time.perf_counter())
            status, details = SubStatus.COMPLETED, ""
        except Exception as exc:  # noqa: BLE001 - answered as flwr-clientapp answers it: an error reply
            code = (ErrorCode.LOAD_CLIENT_APP_EXCEPTION if isinstance(exc, LoadClientAppError)
                    else ErrorCode.CLIENT_APP_RAISED_EXCEPTION)
            details = f"{type(exc)}:<'{exc}'>"
            log.exception("the ClientApp raised")
            if message is not None:
                reply = Message(Error(code=code, reason=details), reply_to=message)
        finally:  # whatever happens to this task, the process goes on to the next one
            self.report_back(client, beat, reply, context, status, details)
        marks.append(time.perf_counter())
        phases = ", ".join(f"{name} {b - a:.2f} s" for name, a, b in zip(("pull", "app", "push"), marks, marks[1:]))
        return f"{message.metadata.message_type if message is not None else '?'} message; {phases}"

    @staticmethod
    def heartbeat_fn(client: RuntimeHttpClient):
        request = SendTaskHeartbeatRequest()

        def heartbeat() -> bool:
            try:
                client.SendTaskHeartbeat(request)  # a task the node has given up on fails at its next push
            except httpx.HTTPError:
                return False
            return True

        return heartbeat

    @staticmethod
    def report_back(client: RuntimeHttpClient, beat, reply, context, status, details: str) -> None:
        """Push the task's reply and its end to the SuperNode, each failure logged, never raised."""
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
        except Exception:  # noqa: BLE001
            log.exception("could not push the reply to the SuperNode")
        try:
            push_task_output(client=client, context=context, sub_status=status, details=details)
        except Exception:  # noqa: BLE001
            log.exception("could not report the task's end to the SuperNode")
        if beat.is_running:
            beat.stop()
        client.close()
        TaskIdentity.task_id = TaskIdentity.run_id = TaskIdentity.node_id = None

    def serve(self, *, poll_s: float = 0.2, ready_file: str | Path | None = None, max_tasks: int | None = None) -> int:
        """Poll for tasks and run each until SIGTERM or Ctrl-C (or `max_tasks`); 1 when the SuperNode refuses the
        poll (a wrong auth secret), else 0."""

        def on_term(signum, frame):  # SIGTERM ends the loop like Ctrl-C; a running task still reports back
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, on_term)
        if ready_file:
            Path(ready_file).write_text(str(os.getpid()))
        log.info("warm ClientApp process %d serving the SuperNode at %s", os.getpid(), self.address)
        done, unreachable = 0, False
        try:
            while max_tasks is None or done < max_tasks:
                try:
                    res = self.acquirer.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
                except httpx.HTTPError as exc:  # the SuperNode is not up yet, is restarting, or refuses
                    code = exc.response.status_code if isinstance(exc, httpx.HTTPStatusError) else None
                    if code in (401, 403):
                        log.error("the SuperNode at %s refused the task poll (HTTP %d): give this process the file "
                                  "the SuperNode has as --superexec-auth-secret-file", self.address, code)
                        return 1
                    if not unreachable:
                        log.warning("the SuperNode's Runtime API at %s does not answer (%s); retrying",
                                    self.address, f"HTTP {code}" if code else type(exc).__name__)
                    unreachable = True
                    time.sleep(max(poll_s, 1.0))
                    continue
                unreachable = False
                if not (res.HasField("task") and res.token):
                    time.sleep(poll_s)
                    continue
                t0 = time.perf_counter()
                what = self.run_task(res.token)
                done += 1
                log.info("task %d done in %.2f s in process %d (%s)", done, time.perf_counter() - t0, os.getpid(),
                         what)
        except KeyboardInterrupt:
            pass
        finally:
            self.acquirer.close()
            sys.stdout.flush()
        return 0
