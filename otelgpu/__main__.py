import sys

from otelgpu.cli import main

sys.exit(main())
