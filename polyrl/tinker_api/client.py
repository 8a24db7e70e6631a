"""A full-parameter training client for the official ``tinker`` SDK.

Tinker's API creates a model without adapters when ``create_model`` carries no ``lora_config``, and this server
trains every parameter then; the SDK (0.38) has no public method that sends such a request. This one does what
``ServiceClient.create_lora_training_client`` does with ``lora_config`` left out, through the SDK's internals.
"""

from __future__ import annotations

import time

import tinker
from tinker import types
from tinker.lib.api_future_impl import _APIFuture
from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
from tinker.lib.public_interfaces.training_client import fetch_training_info


def create_full_training_client(service_client: tinker.ServiceClient, base_model: str) -> tinker.TrainingClient:
    holder = service_client.holder
    session_id, seq = holder.get_session_id(), holder.get_training_client_id()

    async def create() -> tinker.TrainingClient:
        request = types.CreateModelRequest(session_id=session_id, model_seq_id=seq, base_model=base_model)
        with holder.aclient(ClientConnectionPoolType.TRAIN) as client:
            future = await client.models.create(request=request)
        created = await _APIFuture(types.CreateModelResponse, holder, future, request_start_time=time.time(),
                                   request_type="CreateModel").result_async()
        info = await fetch_training_info(holder, created.model_id)
        return tinker.TrainingClient(holder, model_seq_id=seq, model_id=created.model_id, info=info)

    return holder.run_coroutine_threadsafe(create()).result()
