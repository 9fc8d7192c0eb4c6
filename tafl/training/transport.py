"""How the server reaches its clients: the only thing the two engines do differently (docs/design.md, "Federated learning").

The round loop in `simulator` talks to a `Transport`: a census of every client's statistics
before training, the statistics of a round's participants, and their `client_update` results.
`InProcessTransport` calls the method's steps directly on simulated clients that share one copy
of the data; `tafl.training.flower.FlowerTransport` sends the same payloads as Flower messages
to SuperNodes. Method code never knows which one runs it.
"""

from __future__ import annotations

import time

from tafl.training.contract import ClientData, ClientResult, Method, RoundConfig, Tensors, tensor_bytes


class Transport:
    num_clients: int

    def census(self) -> dict[int, Tensors]:
        """Every client's statistics (class counts, ...), before round 1."""
        raise NotImplementedError

    def stats(self, ids: list[int]) -> dict[int, Tensors]:
        raise NotImplementedError

    def train(self, ids: list[int], payload: Tensors,
              round_cfg: RoundConfig) -> tuple[list[ClientResult], dict[str, float]]:
        """Results of the clients that answered, and the cost: client_s, uplink_bytes, downlink_bytes."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class InProcessTransport(Transport):
    def __init__(self, method: Method, clients: list[ClientData]):
        self.method, self.clients = method, clients
        self.num_clients = len(clients)

    def census(self) -> dict[int, Tensors]:
        return self.stats(list(range(self.num_clients)))

    def stats(self, ids: list[int]) -> dict[int, Tensors]:
        return {k: self.method.client_stats(self.clients[k]) for k in ids}

    def train(self, ids, payload, round_cfg):
        results, cost = [], {"client_s": 0.0, "uplink_bytes": 0, "downlink_bytes": tensor_bytes(payload) * len(ids)}
        for k in ids:
            t0 = time.perf_counter()
            res = self.method.client_update(payload, self.clients[k], round_cfg)
            cost["client_s"] += time.perf_counter() - t0
            cost["uplink_bytes"] += tensor_bytes(res.weights) + tensor_bytes(res.extras)
            results.append(res)
        return results, cost
