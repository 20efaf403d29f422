"""The objectives beyond next-token prediction.

dpo             DPO's loss behind --loss_type, its reward metrics, evaluation
reference       the reference model, held the way the policy is under every config
reward_model    a reward model: pairs scored by a one-output classifier, its loss and use
rewards         GRPO's rewards: built-ins, a user's function, a reward model
rollout         GRPO's rollouts: prompts, completions, the weights sampled from
rollout_stages  rollouts as a ring of layer slices where a whole copy does not fit
scoring         the LM head on the completions' positions only (GRPO's log-probabilities, distillation's divergence)
grpo            GRPO's advantages, log-probabilities and clipped policy loss (GSPO, RLOO)
distill         distillation: the teacher, on-policy windows, the generalised JSD
"""
