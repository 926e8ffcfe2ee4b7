"""/v1/models tells the web UI each model's context length and, from its card, the one-line
description and example prompts shown in an empty chat."""

from __future__ import annotations

from api.model_info import card_summary


def test_card_summary_reads_the_bold_first_paragraph_and_the_try_line(tmp_path):
    (tmp_path / "README.md").write_text(
        '# demo\n\n**Knows 400 common words (97.5% right).**\n\nTry: "What does water mean?", "Hi"\n\nMore text.\n'
    )
    summary = card_summary(str(tmp_path))
    assert summary.description == "Knows 400 common words (97.5% right)."
    assert summary.example_prompts == ("What does water mean?", "Hi")
    assert card_summary(str(tmp_path / "missing")).description is None


async def test_models_list_carries_context_length_and_card_fields(make_client, tmp_path, tiny_model_dir):
    client = await make_client()
    models = (await (await client.get("/v1/models")).json())["data"]
    assert {m["id"] for m in models} == {"echo", "echo2"}
    assert all(m["max_model_len"] > 0 and "description" not in m for m in models)  # no card in the folder
