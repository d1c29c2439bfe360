"""Math data for OAR recipes in verl's RL parquet format.

``math_sources`` declares the source datasets (one entry each: hub name, split, fields, how the
final answer is read); ``prepare_math`` is the CLI that writes the train and eval parquet files
(``python -m verl_oar.data.prepare_math --out DIR``). The reward that grades these rows is
``verl_oar.rewards.math_reward``; both read final answers with ``verl_oar.core.answer_span.find_answer_span``.
"""
