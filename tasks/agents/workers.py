"""Where tools and environments run: spawned worker processes (as the reward functions' are), each with a main thread
of its own for the timeouts, holding the episodes' state. Trajectory i lives in worker i mod n, so its environment
instance stays in one process for its whole episode; the workers answer a turn's requests side by side.

A tool or an environment that raises, hangs or returns garbage is an error in the answer (tools.py,
environments.py); a worker that dies is one line naming it, and the stage fails (a rerun starts over).
"""

from __future__ import annotations

from dataclasses import asdict

from schemas.errors import RewardLoadError, UserError
from tasks.agents import environments
from tasks.agents.contained import contained
from tasks.agents.tool_calls import ToolCall
from tasks.agents.tools import Observation, call_tool, load_tools
from tasks.rewards.loader import FunctionSpec
from tasks.rewards.pool import WorkerContext


class AgentWorkerError(UserError, RuntimeError):
    pass


def _serve(conn, tool_specs: list[dict], env_spec: dict | None, env_kwargs: dict, timeouts: tuple[float, float]):
    """A worker's loop: load the tools and the environment class once, then answer (op, items) until told to stop."""
    tool_timeout, step_timeout = timeouts
    try:
        tools = load_tools([FunctionSpec(**s) for s in tool_specs])
        env_class = environments.load_environment(FunctionSpec(**env_spec)) if env_spec else None
        conn.send(("ready", None))
    except RewardLoadError as exc:
        conn.send(("error", str(exc)))
        return
    episodes: dict = {}
    while True:
        op, items = conn.recv()
        if op == "stop":
            return
        if op == "reset":
            out = []
            for key, row in items:
                made, error = contained(lambda: env_class(**env_kwargs), step_timeout, "environment")
                if error:
                    out.append(([], error))
                    continue
                episodes[key] = made
                out.append(environments.reset(made, row, step_timeout))
        elif op == "step":
            out = [environments.step(episodes[key], messages, step_timeout) for key, messages in items]
        else:  # "tools"
            out = [
                [
                    Observation(f"error: {c.error}", c.error, 0.0)
                    if c.error
                    else call_tool(tools, c.name, c.arguments, tool_timeout)
                    for c in calls
                ]
                for _, calls in items
            ]
        conn.send(("ok", out))


class AgentWorkers:
    def __init__(
        self,
        tools: list[FunctionSpec],
        environment: FunctionSpec | None,
        env_kwargs: dict,
        workers: int,
        tool_timeout_s: float,
        step_timeout_s: float,
    ):
        ctx = WorkerContext()
        self.conns, self.procs = [], []
        for _ in range(max(1, workers)):
            parent, child = ctx.Pipe()
            args = (
                child,
                [asdict(t) for t in tools],
                asdict(environment) if environment else None,
                env_kwargs,
                (tool_timeout_s, step_timeout_s),
            )
            proc = ctx.Process(target=_serve, args=args, daemon=True)  # daemonic: ended with the stage's process
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:
            status, error = self._recv(conn)
            if status == "error":
                self.close()
                raise AgentWorkerError(error)

    def _recv(self, conn):
        try:
            return conn.recv()
        except (EOFError, OSError):
            self.close()
            raise AgentWorkerError("an agent worker died (a tool or the environment killed its process)") from None

    def _ask(self, op: str, items: list[tuple[int, object]]) -> list:
        """Each item (trajectory index, payload) to its worker; the answers in the items' order."""
        n = len(self.conns)
        shares = [[(k, item) for k, item in enumerate(items) if item[0] % n == w] for w in range(n)]
        for conn, share in zip(self.conns, shares):
            conn.send((op, [item for _, item in share]))
        out: list = [None] * len(items)
        for conn, share in zip(self.conns, shares):
            _, answers = self._recv(conn)
            for (k, _), answer in zip(share, answers):
                out[k] = answer
        return out

    def reset(self, rows: list[tuple[int, dict]]) -> list[tuple[list[dict], str | None]]:
        return self._ask("reset", rows)

    def step(self, conversations: list[tuple[int, list[dict]]]) -> list[environments.Step]:
        return self._ask("step", conversations)

    def call_tools(self, calls: list[tuple[int, list[ToolCall]]]) -> list[list[Observation]]:
        return self._ask("tools", calls)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop", None))
            except (OSError, BrokenPipeError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        self.conns, self.procs = [], []
