"""Post-training objectives on the one executor: DPO (sigmoid, IPO, conservative) and top-K logit distillation.

objective.py      the objective contract the trainer calls, the language model's loss, side passes of frozen models
dpo.py            DPO's loss, its last-stage step and objective; dpo_data.py the preference pairs;
                  dpo_reference.py the reference (adapters off, a frozen copy, or a precomputed table)
distill.py        top-K distillation's loss, the live teacher; teacher_cache.py / cache_writer.py the cache
reference.py      frozen models beside the trained one (adapters switched off, a frozen copy at the run's layout)
"""
