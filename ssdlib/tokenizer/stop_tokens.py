"""Which token ids end generation.

A checkpoint names one EOS id, but chat models end a *turn* with a marker of their chat template
(``<|im_end|>`` for ChatML models such as SmolLM2, ``<|eot_id|>``/``<|eom_id|>`` for Llama 3).
Stopping only on the declared EOS would let a chat model run on past the end of its answer, so the
stop set is the declared EOS ids plus every end-of-turn marker that is in the vocabulary *and*
written by the model's chat template (a base model without that template keeps just its EOS).
This matches the ``eos_token_id`` lists that models ship in ``generation_config.json``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def stop_token_ids(declared: Iterable[int | None], token_to_id: Callable[[str], int | None],
                   chat_template: str | None) -> list[int]:
    """The declared EOS ids (order kept, duplicates dropped) plus the template's end-of-turn ids."""
    ids = [int(i) for i in declared if i is not None]
    if chat_template:
        for marker in END_OF_TURN_MARKERS:
            if marker in chat_template:
                marker_id = token_to_id(marker)
                if marker_id is not None:
                    ids.append(marker_id)
    return list(dict.fromkeys(ids))
