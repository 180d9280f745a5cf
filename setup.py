"""megatron-preflight: pre-flight checks and resharding for Megatron-LM checkpoints."""

from setuptools import find_packages, setup

setup(
    name="megatron-preflight",
    version="0.1.0",
    description=(
        "Checks a Megatron-LM checkpoint against the run's args before the job builds anything, "
        "picks the loader, and reshards legacy checkpoints across TP/PP/EP/ETP/VPP."
    ),
    packages=find_packages(include=["megatron_preflight", "megatron_preflight.*"]),
    python_requires=">=3.10",
    # Install the torch you want first (see README): any torch >= 2.4 satisfies this, so pip adds nothing.
    install_requires=["torch>=2.4", "pyyaml>=5.4", "numpy>=1.21"],  # numpy: fingerprints
    extras_require={
        "megatron": ["megatron-core>=0.12", "psutil"],
        # ISA-L's CRC-32 (~15 GiB/s, zlib's ~3): every record read is checked against its stored CRC
        "fast-crc": ["isal>=1.0"],
        "test": ["pytest>=7", "hypothesis>=6", "ruff", "psutil"],
    },
    entry_points={"console_scripts": ["megatron-preflight=megatron_preflight.cli.main:main"]},
)
