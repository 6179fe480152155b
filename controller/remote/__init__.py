"""The one client of ctl's agent (client.py: Agent), and what it sends and reads.

The programs that run over there (the agent, the host relay, the environment probe) and the loader that joins
their parts into the source that ships live at the bottom of ctl, in controller/farside/.
"""
