"""``actor_rollout_ref.rollout.name=sparsecorr``: verl's rollouts from the sparse decoding engine.

- `SparseCorrServer` (``server.py``): the server actor, an inference copy of the policy and one
  continuous-batching ``sparsecorr.decoding.Scheduler`` behind verl's token-in / token-out
  ``generate``; the scheduler runs on its own engine thread (`EngineDriver`,
  ``sparsecorr.decoding.driver``, shared with OpenRLHF's sparse rollout actor),
  each request joining the running batch at the next step (``requests.py`` parses them);
- ``SparseCorrReplica`` (``replica.py``): verl's ``RolloutReplica``, registered as
  ``sparsecorr`` in ``RolloutReplicaRegistry``;
- ``SparseCorrServerAdapter`` (``adapter.py``): the in-worker rollout verl resolves from
  ``_ROLLOUT_REGISTRY[("sparsecorr", "async")]``, which syncs the actor's weights.

The engine knobs come from ``rollout.engine_kwargs.sparsecorr`` (`EngineOptions`: verl's names
for ``sparsecorr.sampler.SamplerSpec``). Importing
this package imports neither verl nor Ray; ``replica`` and ``adapter`` import both.
"""

from .driver import EngineDriver
from .options import ENGINE_KEY, EngineOptions, engine_options
from .server import SparseCorrServer, copy_weights, load_policy_copy

REPLICA = "sparsecorr_verl.rollout.replica.SparseCorrReplica"
ADAPTER = "sparsecorr_verl.rollout.adapter.SparseCorrServerAdapter"

__all__ = ["ADAPTER", "ENGINE_KEY", "REPLICA", "EngineDriver", "EngineOptions", "SparseCorrServer",
           "copy_weights", "engine_options", "load_policy_copy"]
