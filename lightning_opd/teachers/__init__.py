"""The teacher seam (:mod:`lightning_opd.teachers.base`) and its implementations."""

from lightning_opd.teachers.base import Teacher, TeacherScores, check_teacher_fits, check_teacher_serves, losses_for
from lightning_opd.teachers.in_process import InProcessTeacher
from lightning_opd.teachers.placebo import ShuffledTeacher
from lightning_opd.teachers.privileged import PrivilegedTeacher
from lightning_opd.teachers.remote import RemoteTeacher
from lightning_opd.teachers.routed import RoutedTeacher

__all__ = ["Teacher", "TeacherScores", "check_teacher_fits", "check_teacher_serves", "losses_for", "InProcessTeacher",
           "PrivilegedTeacher", "RemoteTeacher", "RoutedTeacher", "ShuffledTeacher"]
