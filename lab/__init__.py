"""The lab's equipment, which no notebook teaches or imports: the measure runner and the benchmark that write
``data/measurements``, the record writers, and the classroom load test. It imports ``helpers``, never the reverse.

    records     writing a record whole, its host-memory figures and environment stamp
    gpu_busy    the GPU's busy share while decoding, from the driver's samples rather than a tracer
    measure     one placement route measured in a fresh process (``python -m lab.measure``)
    bench       the benchmark grid over fresh processes (``python -m lab.bench``)
    classroom   a room of learners downloading from the mirror at once (``python -m lab.classroom``)
"""
