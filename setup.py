"""Package layout: the repository keeps the model families in models/ and the recipes in recipes/,
and installs them as `archon.models` and `archon.recipes`, so that they never collide with a
user's own top-level `models` or `recipes` package. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

NESTED = {"archon.models": "models", "archon.recipes": "recipes"}

packages = find_packages(include=["archon", "archon.*"])
for name, folder in NESTED.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(
    packages=packages,
    package_dir=NESTED,
    package_data={
        "archon.recipes": ["configs/*.yaml"],
        "archon.demos": ["warm_starts/*.safetensors", "warm_starts/*.tokenizer.json", "drafters/*.safetensors"],
    },
)
