"""The demo harness: `kvgate demo` and `kvgate showcase`.

It starts simulated replicas (`enginesim`) and drives load (`loadtests`) through a real
`kvgate serve`, so it lives outside the gateway's packages: a production install of the
gateway never imports it, and it comes with the extras ``kvgate[sim,load]``.
"""
