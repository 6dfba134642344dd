"""The demo (the main job) runs, persists its agents, and resumes them warm."""

from kvshelf.demo import AGENTS, run_demo


def test_demo_second_run_restores_every_agent(tiny_dirs, tmp_path, capsys):
    first = run_demo(model=str(tiny_dirs["gemma3_text"]), cache_dir=tmp_path, turns=2, max_tokens=4)
    assert first["requests"] == {"hot": len(AGENTS), "warm": 0, "cold": len(AGENTS)}
    second = run_demo(model=str(tiny_dirs["gemma3_text"]), cache_dir=tmp_path, turns=1, max_tokens=4)
    assert second["requests"] == {"hot": 0, "warm": len(AGENTS), "cold": 0}
    out = capsys.readouterr().out
    assert "continuing the conversation at round 3" in out and out.count(" warm ") >= len(AGENTS)
