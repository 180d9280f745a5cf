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
    # numpy: fingerprints. isal: ISA-L's CRC-32 (8.7 GiB/s on the 2-core CI box, zlib's 2.7): every record read is
    # checked against its stored CRC, every record written gets one; installed by default where a wheel exists (the
    # platforms below), elsewhere zlib's is used (crc.implementation() says which)
    install_requires=["torch>=2.4", "pyyaml>=5.4", "numpy>=1.21",
                      'isal>=1.0; platform_machine in "x86_64 AMD64 aarch64 arm64"'],
    extras_require={
        "megatron": ["megatron-core>=0.12", "psutil"],
        "fast-crc": ["isal>=1.0"],
        "msc": ["multi-storage-client[boto3]>=1.0"],  # msc:// checkpoints (object storage, as --enable-msc)  # (kept for older install commands: now a default dependency)
        "test": ["pytest>=7", "hypothesis>=6", "ruff", "psutil"],
    },
    entry_points={"console_scripts": ["megatron-preflight=megatron_preflight.cli.main:entry"]},
)
