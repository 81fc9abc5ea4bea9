from ..cli import leave
from .app import main

leave(main())
