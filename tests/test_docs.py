"""The README keeps up with the code: its layout section names every module."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_layout_names_every_module():
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    modules = [p for p in (ROOT / "minigpt").rglob("*.py") if p.name not in ("__init__.py",
                                                                           "__main__.py")]
    missing = [str(p.relative_to(ROOT)) for p in modules if f"`{p.name}`" not in layout]
    assert not missing, f"README's layout section does not name {missing}"
