import sys
from pathlib import Path

# tests import the shared harness module ``parity`` directly
sys.path.insert(0, str(Path(__file__).resolve().parent))
