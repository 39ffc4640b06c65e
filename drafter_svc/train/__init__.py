"""Training a DFlash drafter for a target (`ddtree-serve train-drafter`): offline, beside serving.

Data: corpora.py (offline text -> units) -> prompts.py (chat prompts, held-out split) -> samples.py (token
samples: prompt + the target's greedy continuation, or plain-text windows) -> batching.py.
Training: blocks.py (anchors, block masks, labels) + target_features.py (the frozen target) -> loss.py
(DFlashTrainModule) -> trainer.py (the loop, checkpoints, FSDP); new_drafter.py builds a fresh drafter.
Evaluation: evaluate.py (acceptance on held-out samples); fast_generate.py (cached greedy generation).
"""
