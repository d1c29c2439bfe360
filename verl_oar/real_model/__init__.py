"""Experiments on a real pretrained model (SmolLM2-135M-Instruct, offline) through verl's real trainer on CPU: the
top layer beside the testbed, over the CPU mode (``cpu``), the model (``tools.prepare_model``) and the task
(``data.arithmetic``). docs/real-model.md."""
