#!/usr/bin/env bash
# GRPO in verl 0.9.1 with sparse rollouts served by sparsecorr's decoding engine
# (rollout.name=sparsecorr) and corrected by sparsecorr (loss_mode=sparsecorr + the Sparse-RL
# correction). One rollout server per GPU, hybrid with the FSDP actor. Usage:
#   bash grpo_sparse_rollout.sh MODEL_PATH TRAIN_PARQUET VAL_PARQUET [more verl overrides]
# The engine knobs (engine_kwargs.sparsecorr.*) are described on the docs' "verl" page.
set -euo pipefail
MODEL=${1:?model path}; TRAIN=${2:?train parquet}; VAL=${3:?val parquet}; shift 3

python -m sparsecorr_verl.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$TRAIN" data.val_files="$VAL" \
    data.train_batch_size=64 data.max_prompt_length=1024 data.max_response_length=4096 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
    actor_rollout_ref.actor.policy_loss.loss_mode=sparsecorr \
    actor_rollout_ref.rollout.name=sparsecorr \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.calculate_log_probs=true \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
    +actor_rollout_ref.rollout.engine_kwargs.sparsecorr.policy=rkv \
    +actor_rollout_ref.rollout.engine_kwargs.sparsecorr.budget=2048 \
    +actor_rollout_ref.rollout.engine_kwargs.sparsecorr.max_batch_size=256 \
    +algorithm.rollout_correction.sparsecorr.preset=sparse_rl \
    trainer.n_gpus_per_node=8 trainer.nnodes=1 \
    "$@"
