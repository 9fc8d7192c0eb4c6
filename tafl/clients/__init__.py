"""Clients of the tafl service: the REST client (`Client`, `AsyncClient`, `ServiceCallError`) and folder scoring."""

from tafl.clients.client import AsyncClient, Client, ExpertVote, FrameResult, Heatmap, Prediction, ServiceCallError

__all__ = ["AsyncClient", "Client", "ExpertVote", "FrameResult", "Heatmap", "Prediction", "ServiceCallError"]
